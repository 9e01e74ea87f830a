"""The Pallas LoRA kernels (interpret mode) against the dense XLA form, on fresh random adapters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lora_kernels import lora_delta, lora_delta_reference, supported

from jaxrunner.platform import H200


def adapters(rng, in_width: int, parts: tuple[int, ...], num_slots: int, rank: int):
    """Random A [in, L * P * R] and block-diagonal B [L * P * R, out] in the runner's slot layout."""
    a = rng.standard_normal((in_width, num_slots * len(parts) * rank)).astype(np.float32)
    b = np.zeros((a.shape[1], sum(parts)), np.float32)
    starts = np.cumsum((0,) + parts)
    for slot in range(num_slots):
        for p in range(len(parts)):
            row = (slot * len(parts) + p) * rank
            b[row : row + rank, starts[p] : starts[p + 1]] = rng.standard_normal((rank, parts[p]))
    return jnp.asarray(a), jnp.asarray(b)


@pytest.mark.parametrize("tokens, parts, slots_used", [
    (37, (128, 64, 64), (0, 1, 2, 3)),  # q|k|v-like parts; tokens not a multiple of the block
    (16, (192,), (0, 2)),  # one part; slots 1 and 3 absent (their blocks skipped)
    (600, (64, 64), (1, 3)),  # gate|up-like, the prefill block size; no base-model token
])
def test_kernels_match_the_dense_form(tokens, parts, slots_used):
    rng = np.random.default_rng(tokens)
    in_width, num_slots, rank = 48, 3, 16
    a, b = adapters(rng, in_width, parts, num_slots, rank)
    x = jnp.asarray(rng.standard_normal((tokens, in_width)).astype(np.float32))
    slots = jnp.asarray(rng.choice(slots_used, tokens).astype(np.int32))
    got = lora_delta(x, a, b, slots, num_slots=num_slots, part_widths=parts, interpret=True)
    want = lora_delta_reference(x, a, b, slots, num_slots)
    assert got.shape == (tokens, sum(parts))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-3)
    base_rows = np.asarray(slots) == 0
    assert np.all(np.asarray(got)[base_rows] == 0) and np.abs(np.asarray(got)[~base_rows]).max() > 1


def test_bf16_within_bf16_tolerance():
    rng = np.random.default_rng(7)
    a, b = adapters(rng, 64, (64, 128), 2, 32)
    x = jnp.asarray(rng.standard_normal((40, 64)), jnp.bfloat16)
    slots = jnp.asarray(rng.integers(0, 3, 40).astype(np.int32))
    a16, b16 = (0.1 * a).astype(jnp.bfloat16), (0.1 * b).astype(jnp.bfloat16)
    got = lora_delta(x, a16, b16, slots, num_slots=2, part_widths=(64, 128), interpret=True)
    want = lora_delta_reference(x.astype(jnp.float32), a16.astype(jnp.float32), b16.astype(jnp.float32), slots, 2)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=3e-2, atol=3e-2)


def test_shapes_the_kernels_cannot_run_are_refused():
    assert supported(1024, (2048, 1024, 1024), 16) and supported(3072, (1024,), 64)
    assert not supported(1024, (2048,), 8)  # Triton's dot needs K >= 16
    assert not supported(1024, (2048,), 24)  # not a power of two
    assert not supported(1000, (2048,), 16) and not supported(1024, (2040,), 16)
    x = jnp.zeros((4, 64))
    a, b = jnp.zeros((64, 8)), jnp.zeros((8, 64))
    with pytest.raises(ValueError, match="power-of-two rank"):
        lora_delta(x, a, b, jnp.zeros(4, jnp.int32), num_slots=1, part_widths=(64,), interpret=True)


@pytest.mark.parametrize("tokens", [256, 8192])
def test_lowers_to_triton_for_h200(tokens):
    """The Pallas -> Triton lowering (what jax runs before XLA compiles the Triton IR on the GPU),
    at Qwen3-0.6B's q|k|v: Triton's lowering lacks ops interpret mode has (reduce_or, say)."""
    sds = jax.ShapeDtypeStruct
    args = (sds((tokens, 1024), jnp.bfloat16), sds((1024, 192), jnp.bfloat16), sds((192, 4096), jnp.bfloat16),
            sds((tokens,), jnp.int32))
    fn = jax.jit(lambda x, a, b, s: lora_delta(x, a, b, s, num_slots=4, part_widths=(2048, 1024, 1024)))
    with jax.sharding.use_abstract_mesh(H200):
        text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, run_length", [(256, 1), (2048, 512)])
def test_compiled_kernels_on_gpu_at_qwen3_shapes(tokens, run_length):
    """Qwen3-0.6B's q|k|v and down projections, 4 slots of rank 16, bf16, compiled through Triton."""
    rng = np.random.default_rng(tokens)
    for in_width, parts in ((1024, (2048, 1024, 1024)), (3072, (1024,))):
        a, b = adapters(rng, in_width, parts, 4, 16)
        a, b = (0.05 * a).astype(jnp.bfloat16), (0.05 * b).astype(jnp.bfloat16)
        x = jnp.asarray(rng.standard_normal((tokens, in_width)), jnp.bfloat16)
        slots = jnp.asarray(np.repeat(rng.integers(0, 5, tokens // run_length), run_length).astype(np.int32))
        got = lora_delta(x, a, b, slots, num_slots=4, part_widths=parts)
        want = lora_delta_reference(*(v.astype(jnp.float32) for v in (x, a, b)), slots, 4)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=3e-2, atol=5e-2)
