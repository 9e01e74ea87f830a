"""The Mosaic GPU kernel for decode-shaped matmuls (`pallas_kernels/quantized_matmul.py`).

Without a GPU: the kernel lowers for Hopper (Mosaic GPU lowers on any machine; only its PTX needs the
GPU), its fp8, bf16 and grouped forms run in Mosaic GPU's interpreter against references, and
`quantization.matmul` sends decode-shaped fp8 and int8 calls to it (bf16 ones with kernels="mosaic")
and the rest to XLA.
On the H200 (`-m gpu`): each form against a reference on fresh random weights, and a model whose
programs run it scoring a prompt as the same model does through XLA.
"""

from __future__ import annotations

import functools
import gc
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxrunner import LLM, SamplingParams, platform
from jaxrunner.models import quantization
from jaxrunner.models.quantization import quantize
from pallas_kernels import quantized_matmul as kernel

DATA = Path(__file__).parent / "data"
CASES = [  # (format, K, N)
    ("fp8", 4096, 6144), ("fp8", 192, 128),
    ("int8", 4096, 6144), ("int8", 14336, 256), ("int8", 64, 128),
    ("int4", 4096, 6144), ("int4", 14336, 256), ("int4", 192, 128),  # steps of 256, 128 and 64 rows of K
]


def _lowered(f, *args) -> str:
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_the_bf16_form_lowers_for_hopper():
    x, w = jax.ShapeDtypeStruct((16, 4096), jnp.bfloat16), jax.ShapeDtypeStruct((4096, 6144), jnp.bfloat16)
    assert "mosaic_gpu" in _lowered(functools.partial(kernel.dense_matmul, num_sms=132), x, w)


@pytest.mark.parametrize("fmt,k,n", CASES)
def test_the_kernel_lowers_for_hopper(fmt, k, n):
    w = jax.eval_shape(functools.partial(quantize, fmt=fmt), jax.ShapeDtypeStruct((k, n), jnp.float32))
    x = jax.ShapeDtypeStruct((16, k), jnp.bfloat16)
    assert kernel.supported(16, w.values, w.scales, offsets=fmt == "int4")
    text = _lowered(functools.partial(kernel.quantized_matmul, num_sms=132), x, w.values, w.scales, w.offsets)
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("rows,fmt,num_sms,dense,runs", [
    (16, "fp8", 132, False, True), (64, "int8", 132, False, True),
    (128, "fp8", 132, False, False),  # a prefill's rows: XLA, bound by compute there
    (16, "int4", 132, False, True),
    (16, "int8", 0, False, False),  # no GPU kernels (the references, or a CPU)
    (16, "bf16", 132, True, True),  # kernels="mosaic": bf16 weights too
    (16, "bf16", 132, False, False), (128, "bf16", 132, True, False),
])
def test_decode_shaped_calls_take_the_kernel(rows, fmt, num_sms, dense, runs):
    w = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16)
    if fmt != "bf16":
        w = jax.eval_shape(functools.partial(quantize, fmt=fmt), jax.ShapeDtypeStruct((256, 128), jnp.float32))
    x = jax.ShapeDtypeStruct((rows, 256), jnp.bfloat16)
    text = _lowered(functools.partial(quantization.matmul, num_sms=num_sms, dense=dense), x, w)
    assert ("mosaic_gpu" in text) == runs


def test_int4_values_reach_the_kernel_as_bytes_of_even_and_odd_rows():
    """`int4_operands`: byte j of a group's row holds K row 2j in its low nibble and 2j + 1 in its
    high one, and x's columns follow, each group's even columns and then its odd ones, so that each
    nibble's 16 values multiply 16 contiguous columns; the products add up to x @ W."""
    rng = np.random.default_rng(4)
    n, k = 64, 96
    values = rng.integers(0, 16, (n, k))
    x = rng.standard_normal((8, k)).astype(np.float32)
    packed, xp = (np.asarray(a) for a in kernel.int4_operands(jnp.asarray(values, jnp.uint4), jnp.asarray(x)))
    assert packed.dtype == np.uint8 and packed.shape == (n, k // 2)
    np.testing.assert_array_equal(packed & 15, values[:, 0::2])
    np.testing.assert_array_equal(packed >> 4, values[:, 1::2])
    groups = [(packed[:, g * 16:(g + 1) * 16], xp[:, g * 32:(g + 1) * 32]) for g in range(k // 32)]
    got = sum((q & 15) @ c[:, :16].T + (q >> 4) @ c[:, 16:].T for q, c in groups)
    np.testing.assert_allclose(got, values @ x.T, rtol=1e-5, atol=1e-4)


def test_split_count_fills_the_gpu():
    assert kernel.split_count(6144, 32, 132) == 4  # 96 tiles of 64 columns: 4 K ranges of 8 steps
    assert kernel.split_count(28672, 32, 132) == 2  # 448 tiles already fill 132 SMs
    assert kernel.split_count(4096, 8, 132) == 2  # a short K keeps whole pipelines
    assert kernel.split_count(128, 1, 132) == 1


def _reference(x: np.ndarray, values: np.ndarray, scales: np.ndarray, fp8: bool,
               offsets: np.ndarray | None = None) -> np.ndarray:
    """float32 x @ W in numpy: W from the values [N, K], scales [G, N] and offsets [G, N] if any;
    fp8 rounds x per row to e4m3."""
    n, k = values.shape
    w = values.astype(np.float32).reshape(n, scales.shape[0], -1) * scales.T[:, :, None]
    if offsets is not None and offsets.size:
        w = w + offsets.T[:, :, None]
    if fp8:
        scale = np.abs(x).max(axis=1, keepdims=True) / 448
        x = (x / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale
    return x @ w.reshape(n, k).T


@pytest.mark.parametrize("k, n, rows", [(4096, 256, 16), (192, 128, 8)])
def test_the_fp8_kernel_interpreted_matches_the_reference(k, n, rows):
    """The fp8 form simulated on the CPU (Mosaic GPU's interpreter): 2 K ranges of 16 steps of 128,
    then 3 steps of 64 in one range; int8's register operand cannot be interpreted."""
    rng = np.random.default_rng(k + rows)
    w = quantize(jnp.asarray(rng.standard_normal((k, n)) * rng.uniform(0.01, 1, (1, n)), jnp.float32), "fp8")
    x = np.asarray(jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16).astype(jnp.float32))
    got = kernel.quantized_matmul(jnp.asarray(x, jnp.bfloat16), w.values, w.scales, num_sms=2, interpret=True)
    want = _reference(x, np.asarray(w.values.astype(jnp.float32)), np.asarray(w.scales), True)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
    held = quantize(jnp.zeros((256, 128), jnp.float32), "int8")
    with pytest.raises(ValueError, match="interprets fp8 weights only"):
        kernel.quantized_matmul(jnp.zeros((8, 256), jnp.bfloat16), held.values, held.scales, num_sms=2, interpret=True)


@pytest.mark.parametrize("k, n, rows", [(512, 128, 16), (192, 256, 8)])
def test_the_bf16_form_interpreted_matches_the_product(k, n, rows):
    """`dense_matmul`: a bf16 weight as the layers hold it ([K, N], its tiles read transposed),
    simulated on the CPU: 2 K ranges of 2 steps of 128, then one range of 3 steps of 64."""
    rng = np.random.default_rng(k + n)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) * 0.05, jnp.bfloat16)
    got = kernel.dense_matmul(x, w, num_sms=2, interpret=True)
    want = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
    assert not kernel.dense_supported(72, w) and not kernel.dense_supported(16, w.astype(jnp.float32))


@pytest.mark.parametrize("tiling", [kernel.Tiling(rows=128, splits=1, stages=2), kernel.Tiling(step=64, splits=4)])
def test_other_cuts_interpreted_give_the_same_product(tiling):
    """`Tiling`'s other cuts (for `benchmarks/matmul.py --sweep`): 128 weight rows a program in one
    K range, or steps of 64 in 4 ranges, fp8 and bf16, simulated on the CPU against the references;
    cuts that do not divide K's steps, the steps or N's rows (or rows not whole wgmmas) are refused."""
    rng = np.random.default_rng(tiling.rows + tiling.splits)
    k, n, rows = 512, 256, 16
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) * 0.05, jnp.bfloat16)
    want = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
    got = kernel.dense_matmul(x, w, num_sms=2, interpret=True, tiling=tiling)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
    held = quantize(jnp.asarray(w, jnp.float32), "fp8")
    got = kernel.quantized_matmul(x, held.values, held.scales, num_sms=2, interpret=True, tiling=tiling)
    want = _reference(np.asarray(x, np.float32), np.asarray(held.values.astype(jnp.float32)), np.asarray(held.scales), True)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
    for cuts in (kernel.Tiling(splits=3), kernel.Tiling(step=384), kernel.Tiling(rows=96)):
        with pytest.raises(ValueError, match="choose cuts that divide them"):
            kernel.dense_matmul(x, w, num_sms=2, interpret=True, tiling=cuts)


def _groups(rng, rows: int, experts: int, routed: int) -> jax.Array:
    """Group sizes for `routed` of `rows` rows (the rest past every group) over `experts` experts,
    some of them empty."""
    chosen = rng.choice(experts, size=max(1, experts // 2), replace=False)
    return jnp.asarray(np.bincount(rng.choice(chosen, size=routed), minlength=experts), jnp.int32)


@pytest.mark.parametrize("k, n, sizes, rows", [(256, 128, (3, 0, 11, 1, 0, 3), 20), (192, 64, (0, 40, 2, 30), 72)])
def test_the_grouped_form_interpreted_matches_ragged_dot(k, n, sizes, rows):
    """`grouped_dense_matmul` simulated on the CPU against `ragged_dot`: empty experts, rows past
    every group (zeros), a group over two tiles (of 8, then of 32 rows); 2 K ranges of 128, then
    of 64."""
    rng = np.random.default_rng(k + rows)
    experts, routed = len(sizes), sum(sizes)
    assert max(sizes) > kernel.grouped_tile(rows, experts)
    sizes = jnp.asarray(sizes, jnp.int32)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((experts, k, n)) * 0.05, jnp.bfloat16)
    got = kernel.grouped_dense_matmul(x, w, sizes, num_sms=2, interpret=True)
    want = jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), sizes, precision="highest")
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=2e-2,
                               atol=2e-2 * float(jnp.abs(want).max()))
    assert not np.asarray(got[routed:]).any()


def test_the_grouped_form_takes_a_decodes_rows_only():
    w = jax.ShapeDtypeStruct((128, 2048, 1536), jnp.bfloat16)  # Qwen3-30B-A3B's gate|up
    assert [kernel.grouped_tile(r, 128) for r in (8, 512, 2048, 8192)] == [8, 8, 16, 64]
    assert kernel.grouped_supported(8192, w) and not kernel.grouped_supported(8193, w)  # a prefill: the Triton kernel
    assert not kernel.grouped_supported(8, jax.ShapeDtypeStruct((128, 2048, 1536), jnp.float32))
    assert not kernel.grouped_supported(8, jax.ShapeDtypeStruct((128, 2048, 96), jnp.bfloat16))


@pytest.mark.parametrize("rows", [8, 512, 2048])  # Qwen3-30B-A3B's decodes at batch 1, 64 and 256
def test_the_grouped_form_lowers_for_hopper(rows):
    for k, n in ((2048, 1536), (768, 2048)):
        args = (jax.ShapeDtypeStruct((rows, k), jnp.bfloat16), jax.ShapeDtypeStruct((128, k, n), jnp.bfloat16),
                jax.ShapeDtypeStruct((128,), jnp.int32))
        assert "mosaic_gpu" in _lowered(functools.partial(kernel.grouped_dense_matmul, num_sms=132), *args)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [8, 512, 2048])
@pytest.mark.parametrize("k, n", [(2048, 1536), (768, 2048)])
def test_the_grouped_form_matches_ragged_dot_on_the_gpu(k, n, rows):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    rng = np.random.default_rng(k + rows)
    sizes = _groups(rng, rows, 128, rows - 3)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(k + rows), (128, k, n)) * 0.02).astype(jnp.bfloat16)  # on the device
    got = kernel.grouped_dense_matmul(x, w, sizes, num_sms=platform.num_sms())
    want = jax.lax.ragged_dot(x, w, sizes, precision="highest", preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=2e-2, atol=2e-2)
    assert not np.asarray(got[rows - 3:]).any()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [8, 16, 64])
@pytest.mark.parametrize("fmt,k,n", CASES)
def test_the_kernel_matches_the_reference(fmt, k, n, rows):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    rng = np.random.default_rng(k + n + rows)
    w = quantize(jnp.asarray(rng.standard_normal((k, n)) * rng.uniform(0.01, 1, (1, n)), jnp.float32), fmt)
    x = (rng.standard_normal((rows, k)) * rng.uniform(0.1, 10, (rows, 1))).astype(np.float32)
    x = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))  # the kernel takes bf16 tokens
    offsets = w.offsets if w.offsets.size else None
    got = kernel.quantized_matmul(jnp.asarray(x, jnp.bfloat16), w.values, w.scales, offsets, num_sms=platform.num_sms())
    want = _reference(x, np.asarray(w.values.astype(jnp.float32)), np.asarray(w.scales), fmt == "fp8",
                      np.asarray(w.offsets))
    # bf16 output; int8 and int4 also round each scaled weight to bf16 before the tensor cores
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [8, 16, 64])
@pytest.mark.parametrize("k, n", [(4096, 6144), (4096, 4096), (14336, 4096), (1024, 4096)])
def test_the_bf16_form_matches_xla_on_the_gpu(k, n, rows):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    rng = np.random.default_rng(k + n + rows)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) * 0.02, jnp.bfloat16)
    got = kernel.dense_matmul(x, w, num_sms=platform.num_sms())
    want = jnp.dot(x, w, preferred_element_type=jnp.float32, precision="highest")
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4", "bf16"])
def test_a_model_runs_the_kernel_and_scores_as_through_xla(fmt, monkeypatch, tmp_path):
    """tiny-llama held in `fmt` (bf16: with kernels="mosaic"): its prompt logprobs with the kernel
    in its programs (the calls counted as they trace) against the same model's through XLA alone
    (the kernel refused)."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    prompt = np.load(DATA / "goldens" / "tiny-llama.npz")["prompt_0"].tolist()
    score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    options = dict(kernels="mosaic") if fmt == "bf16" else dict(quantization=fmt)

    def logprobs() -> np.ndarray:
        with LLM(str(DATA / "models" / "tiny-llama"), dtype="bfloat16", skip_tokenizer_init=True, max_model_len=128,
                 max_num_seqs=2, num_gpu_blocks_override=32, **options) as llm:
            out = llm.generate([prompt], score, use_tqdm=False)[0]
        return np.array([d[t].logprob for t, d in zip(prompt[1:], out.prompt_logprobs[1:])])

    entry, check = ("dense_matmul", "dense_supported") if fmt == "bf16" else ("quantized_matmul", "supported")
    calls, traced = [], getattr(kernel, entry)
    monkeypatch.setattr(kernel, entry, lambda *a, **k: calls.append(a[1].shape) or traced(*a, **k))
    with_kernel = logprobs()
    assert calls, "no projection ran the kernel"
    refused = []

    def refuse(*args) -> bool:
        refused.append(args)
        return False

    monkeypatch.setattr(kernel, check, refuse)
    calls.clear()
    gc.collect()  # the first engine's programs go with it,
    jax.clear_caches()  # the step functions trace again: without the kernel now,
    monkeypatch.setenv("JAXRUNNER_CACHE", str(tmp_path))  # and no program cache serves the kernel's
    through_xla = logprobs()
    assert refused and not calls, "the second engine did not trace its programs again"
    np.testing.assert_allclose(with_kernel, through_xla, atol=0.1)
