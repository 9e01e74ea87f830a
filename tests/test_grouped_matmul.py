"""The Pallas grouped matmul (`pallas_kernels.grouped_matmul`) against `jax.lax.ragged_dot` on fresh
random inputs, interpreted on the CPU (empty groups, rows past every group, decode- and prefill-sized
tiles, fixed tiles and their XLA form, rhs held transposed, K in ranges), and its Triton lowering for an H200 at the Qwen3-30B-A3B expert shapes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrunner.config import Kernels
from jaxrunner.checkpoints.dummy import shape
from jaxrunner.models.row_tiles import GROUPED_TILE_ROWS, fixed_tile_matmul
from jaxrunner.platform import H200
from jaxrunner.runner.step import moe_matmul
from pallas_kernels.grouped_matmul import block_rows, grouped_matmul, grouped_matmul_in_tiles


@pytest.mark.parametrize("rows, k, n, groups, past", [(37, 32, 48, 6, 3), (16, 64, 64, 8, 15), (700, 16, 32, 4, 20)])
def test_equals_ragged_dot(rows, k, n, groups, past):
    rng = np.random.default_rng(rows)
    sizes = rng.multinomial(rows - past, np.ones(groups) / groups).astype(np.int32)
    sizes[1] = 0  # an empty group
    lhs = rng.standard_normal((rows, k)).astype(np.float32)
    rhs = rng.standard_normal((groups, k, n)).astype(np.float32)
    want = jax.lax.ragged_dot(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes), precision="highest")
    # the kernel in its own tiles and in fixed ones (batch invariance's), and those tiles through XLA
    with jax.default_matmul_precision("highest"):
        for got in (grouped_matmul(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes), interpret=True),
                    grouped_matmul(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes), interpret=True, block_m=32,
                                   block_n=16),
                    grouped_matmul(jnp.asarray(lhs), jnp.asarray(rhs.transpose(0, 2, 1)), jnp.asarray(sizes),
                                   interpret=True, rhs_transposed=True),  # rhs [E, N, K]
                    grouped_matmul_in_tiles(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes), block_m=32)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
            assert not np.asarray(got)[rows - past :].any()  # the rows past every group
    assert block_rows(rows, groups) == (128 if rows == 700 else 16)


def test_a_decodes_few_rows_spread_k_over_programs():
    """`min_programs`: 5 rows over 4 experts give at most 5 tiles x 2 column blocks; K = 1024 is cut
    into 4 ranges of 256 (a program each) to reach 40 programs; the product stays ragged_dot's."""
    rng = np.random.default_rng(12)
    lhs = jnp.asarray(rng.standard_normal((5, 1024)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((4, 1024, 256)), jnp.float32)
    sizes = jnp.asarray([2, 0, 1, 2], jnp.int32)
    product = functools.partial(grouped_matmul, interpret=True, min_programs=40)
    assert "grouped_matmul_m16_n128_k64_s4_spread" in str(jax.make_jaxpr(product)(lhs, rhs, sizes))
    with jax.default_matmul_precision("highest"):
        want = jax.lax.ragged_dot(lhs, rhs, sizes)
        np.testing.assert_allclose(np.asarray(product(lhs, rhs, sizes)), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_k_ranges_give_the_same_bits_spread_over_programs_or_in_one():
    """K in 4 ranges, each summed from zero, then added in order: a range per program (float32
    partials added by XLA after) or all in one program, the same bits, for 3 rows or 100, groups
    or not; the ranges' order is not the one-range order, but the sum is the product."""
    rng = np.random.default_rng(11)
    lhs = jnp.asarray(rng.standard_normal((100, 512)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((3, 512, 64)) * 0.05, jnp.bfloat16)
    sizes = jnp.asarray([40, 0, 57], jnp.int32)
    product = jax.jit(functools.partial(grouped_matmul, interpret=True, block_m=64), static_argnames=("k_splits", "spread_splits"))
    one_range = np.asarray(product(lhs, rhs, sizes), np.float32)
    in_one = np.asarray(product(lhs, rhs, sizes, k_splits=4), np.float32)
    spread = np.asarray(product(lhs, rhs, sizes, k_splits=4, spread_splits=True), np.float32)
    np.testing.assert_array_equal(spread, in_one)
    assert not np.array_equal(in_one, one_range)  # another order of sums: other low bits somewhere
    few = np.asarray(product(lhs[:3], rhs, jnp.asarray([3, 0, 0], jnp.int32), k_splits=4, spread_splits=True), np.float32)
    np.testing.assert_array_equal(few, in_one[:3])
    want = np.concatenate([np.asarray(lhs[:40], np.float32) @ np.asarray(rhs[0], np.float32),
                           np.asarray(lhs[40:97], np.float32) @ np.asarray(rhs[2], np.float32), np.zeros((3, 64))])
    np.testing.assert_allclose(spread, want, rtol=2e-2, atol=2e-2)
    assert "grouped_matmul_m64_n64_k64_s4_spread" in str(jax.make_jaxpr(
        functools.partial(product, k_splits=4, spread_splits=True))(lhs, rhs, sizes))
    with pytest.raises(ValueError, match="cannot cut K=512 into k_splits=3 ranges"):
        grouped_matmul(lhs, rhs, sizes, interpret=True, k_splits=3)


def test_the_pallas_kernels_choose_it_for_moe_models():
    """The kernel with the Pallas kernels, XLA's ragged_dot without; batch-invariant, both in fixed tiles."""
    model = shape("qwen3-30b-a3b")
    chosen = moe_matmul(Kernels.choose("pallas"), model)
    assert chosen.func is grouped_matmul and chosen.keywords["min_programs"] == 2 * Kernels.choose("pallas").num_sms
    assert moe_matmul(Kernels.choose("reference"), model) is jax.lax.ragged_dot
    fixed = moe_matmul(Kernels.choose("pallas", batch_invariant=True), model)
    assert fixed.func is grouped_matmul and fixed.keywords["block_m"] == GROUPED_TILE_ROWS
    fixed = moe_matmul(Kernels.choose("reference", batch_invariant=True), model)
    assert fixed.func is grouped_matmul_in_tiles and fixed.keywords["block_m"] == GROUPED_TILE_ROWS


@pytest.mark.parametrize("tokens, name", [(1, "grouped_matmul_m16_n128_k64_s8_spread"),
                                          (16, "grouped_matmul_m16_n128_k64_s4_spread"),
                                          (64, "grouped_matmul_m16_n128_k64\""),
                                          (8192, "grouped_matmul_m128_n128_k64\"")])
def test_lowers_to_triton_for_the_h200(tokens, name):
    """At the Qwen3-30B-A3B expert shapes, as the runner calls it: a decode bucket's copies spread
    gate|up's K over programs by the fewest tiles they can fill (1 and 8 tiles of 16 rows: 8 and 4
    ranges), since a bucket of 16 tokens may hold one real token whose 8 copies fill 8 tiles."""
    model = shape("qwen3-30b-a3b")
    e, h, i = model.num_experts, model.hidden_size, model.intermediate_size
    copies = tokens * model.num_experts_per_tok
    args = (jax.ShapeDtypeStruct((copies, h), jnp.bfloat16), jax.ShapeDtypeStruct((e, h, 2 * i), jnp.bfloat16),
            jax.ShapeDtypeStruct((e,), jnp.int32))
    with jax.sharding.use_abstract_mesh(H200):
        text = jax.jit(functools.partial(grouped_matmul, min_programs=264)).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()
    assert name in text


@pytest.mark.parametrize("rows, name", [(1, "grouped_matmul_m64_n128_k64_s8_spread"), (2048, "grouped_matmul_m64_n128_k64_s8\"")])
def test_fixed_tiles_lower_to_triton_for_the_h200(rows, name):
    """Batch invariance's projection at Llama-3-8B's down shape: a decode's rows spread its 8 K
    ranges over programs, a prefill's run them in each tile's program."""
    args = (jax.ShapeDtypeStruct((rows, 14336), jnp.bfloat16), jax.ShapeDtypeStruct((14336, 4096), jnp.bfloat16))
    with jax.sharding.use_abstract_mesh(H200):
        text = jax.jit(functools.partial(fixed_tile_matmul, None, interpret=False)).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()
    assert name in text


@pytest.mark.gpu
def test_compiled_on_the_gpu_reads_a_tied_lm_head_as_held():
    """Batch invariance's logits at Qwen3-0.6B's tied head: the embedding [vocab, hidden] as it is
    held, 64-row tiles, fp32 out, against XLA's product."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    model = shape("qwen3-0.6b")
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((100, model.hidden_size)), jnp.bfloat16)
    embed = jnp.asarray(0.02 * rng.standard_normal((model.vocab_size, model.hidden_size)), jnp.bfloat16)
    got = jax.jit(functools.partial(grouped_matmul, block_m=GROUPED_TILE_ROWS, rhs_transposed=True, out_dtype=jnp.float32))(
        x, embed[None], jnp.asarray([100], jnp.int32))
    want = jnp.dot(x, embed.T, preferred_element_type=jnp.float32, precision="highest")
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, k, n", [(1, 4096, 6144), (100, 14336, 4096), (256, 1024, 4096)])
def test_compiled_on_the_gpu_in_fixed_tiles_and_k_ranges(rows, k, n):
    """Batch invariance's projections (`row_tiles.fixed_tile_matmul`: 64-row tiles, `tiling`'s K
    ranges, spread over programs for a decode's rows) at Llama-3-8B's and Qwen3-0.6B's shapes,
    against XLA's product."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    w = jnp.asarray(0.02 * rng.standard_normal((k, n)), jnp.bfloat16)
    got = jax.jit(lambda x, w: fixed_tile_matmul(None, x, w, interpret=False))(x, w)
    want = jnp.dot(x, w, preferred_element_type=jnp.float32, precision="highest")
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("copies, used", [(128, 8), (4096, 128)])
def test_compiled_on_the_gpu_equals_ragged_dot(copies, used):
    """The expert shapes of Qwen3-30B-A3B in bf16: a decode's 8 experts of 128 and a prefill's 128."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    model = shape("qwen3-30b-a3b")
    e, h, i = model.num_experts, model.hidden_size, model.intermediate_size
    rng = np.random.default_rng(copies)
    sizes = np.zeros(e, np.int32)
    sizes[rng.choice(e, used, replace=False)] = rng.multinomial(copies - 5, np.ones(used) / used)
    lhs = jnp.asarray(rng.standard_normal((copies, h)), jnp.bfloat16)
    rhs = jnp.asarray(0.02 * rng.standard_normal((e, h, 2 * i)), jnp.bfloat16)
    want = jax.lax.ragged_dot(lhs.astype(jnp.float32), rhs.astype(jnp.float32), jnp.asarray(sizes), precision="highest")
    for block_m in (0, GROUPED_TILE_ROWS):  # its own tiles, and batch invariance's fixed ones
        got = jax.jit(functools.partial(grouped_matmul, block_m=block_m))(lhs, rhs, jnp.asarray(sizes))
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=2e-2, atol=2e-2)
