"""One pass of the sampler's threshold search as a Pallas (Triton) kernel: tallies for a few candidate keys.

For each row b and candidate key c[b, j], either the number of tokens whose key is >= c, or their
mass: the sum of exp(x - row_max) over those tokens whose key is also >= floor[b]. XLA turns the
same computation (`tally_reference`) into a [B, V, C] reduction; the kernel reads each logit once
per pass and keeps one running sum per candidate in registers. Grid: (rows, splits of the
vocabulary); XLA adds the splits' partial sums.

The candidates per pass trade passes for work per pass: a pass costs about as much compute as
memory traffic, so 4 candidates (14 passes) beat both 2 and 16 on the H200 (the tuning figures are
in docs/benchmarks.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

NUM_CANDIDATES = 4
BLOCK = 1024
SPLITS = 16
NUM_WARPS = 4


def ordered_keys(x: jax.Array) -> jax.Array:
    """i32 keys in the order of the f32 values x (NaN-free; -0 counts as +0)."""
    bits = lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.int32)
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def tally_reference(x: jax.Array, cand: jax.Array, floor: jax.Array, row_max: jax.Array, mass: bool) -> jax.Array:
    """Counts i32 [B, C] (or masses f32 [B, C]) for x f32 [B, V], cand i32 [B, C], floor i32 [B], row_max f32 [B]."""
    keys = ordered_keys(x)
    at_least = keys[:, :, None] >= cand[:, None, :]
    if not mass:
        return jnp.sum(at_least, axis=1, dtype=jnp.int32)
    weights = jnp.where(keys >= floor[:, None], jnp.exp(x - row_max[:, None]), 0.0)
    return jnp.sum(jnp.where(at_least, weights[:, :, None], 0.0), axis=1)


def padded_vocab(vocab: int) -> int:
    """The kernel's vocabulary size: SPLITS splits of a power-of-two number of blocks."""
    split = BLOCK
    while split * SPLITS < vocab:
        split *= 2
    return split * SPLITS


def tally_kernel(
    x: jax.Array, cand: jax.Array, floor: jax.Array, row_max: jax.Array, mass: bool, interpret: bool = False
) -> jax.Array:
    """tally_reference for x already padded with -inf to padded_vocab(V) columns, and C = NUM_CANDIDATES."""
    batch, vocab = x.shape
    split = vocab // SPLITS
    assert vocab == padded_vocab(vocab) and cand.shape == (batch, NUM_CANDIDATES)
    dtype = jnp.float32 if mass else jnp.int32
    partial = pl.pallas_call(
        functools.partial(_tally_body, num_blocks=split // BLOCK, mass=mass),
        out_shape=jax.ShapeDtypeStruct((batch, SPLITS, NUM_CANDIDATES), dtype),
        grid=(batch, SPLITS),
        in_specs=[
            pl.BlockSpec((1, split), lambda b, s: (b, s)),
            pl.BlockSpec((1, NUM_CANDIDATES), lambda b, s: (b, 0)),
            pl.BlockSpec((1, 1), lambda b, s: (b, 0)),
            pl.BlockSpec((1, 1), lambda b, s: (b, 0)),
        ],
        out_specs=pl.BlockSpec((1, 1, NUM_CANDIDATES), lambda b, s: (b, s, 0)),
        compiler_params=plt.CompilerParams(num_warps=NUM_WARPS, num_stages=2),
        interpret=interpret,
        name="sampler_tally",
    )(x, cand, floor[:, None], row_max[:, None])
    return jnp.sum(partial, axis=1)


def _tally_body(x_ref, cand_ref, floor_ref, max_ref, out_ref, *, num_blocks: int, mass: bool) -> None:
    cands = [cand_ref[0, j] for j in range(NUM_CANDIDATES)]
    floor, row_max = floor_ref[0, 0], max_ref[0, 0]

    def block(i: int, sums: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        x = x_ref[0, pl.ds(pl.multiple_of(i * BLOCK, BLOCK), BLOCK)]
        keys = ordered_keys(x)
        if not mass:
            return tuple(s + (keys >= c).astype(jnp.int32) for s, c in zip(sums, cands))
        weights = jnp.where(keys >= floor, jnp.exp(x - row_max), 0.0)
        return tuple(s + jnp.where(keys >= c, weights, 0.0) for s, c in zip(sums, cands))

    zero = jnp.zeros(BLOCK, jnp.float32 if mass else jnp.int32)
    sums = lax.fori_loop(0, num_blocks, block, (zero,) * NUM_CANDIDATES)
    slot = lax.broadcasted_iota(jnp.int32, (NUM_CANDIDATES,), 0)
    out_ref[0, 0, :] = sum(jnp.where(slot == j, jnp.sum(s), 0) for j, s in enumerate(sums)).astype(out_ref.dtype)
