"""Top-k and top-p without a sort: each row's cut-off found by a multi-way search over float bits.

vLLM's (sort-based) semantics: top-k keeps every token whose logit is >= the k-th largest; top-p
then keeps, among those, every token whose probability mass strictly above it is < p, so the most
likely token always stays. Both kept sets are {x >= t}: top-k's t is the largest value with
count(x >= t) >= k, top-p's the largest with mass(x >= t) >= p * mass(top-k's kept set). Such a
largest t is one of the row's own logits, so the search can be exact: it runs over the 2**32
float32 values ordered as ints ("keys"), and each pass tallies C candidate thresholds in one
sweep over the row, shrinking the interval (C + 1)-fold: with C = 4, 14 passes find any key. The
number of passes is fixed (no data-dependent loop, so no device-to-host sync on GPU); a row that
needs no cut starts with an empty interval and the passes leave it alone.

With the runner's Pallas kernels a pass is `pallas_kernels.sampler_tally` (which says how C was
chosen); otherwise the same tally in jnp. Either way 2 searches x 14 passes over the logits cost
less than sorting them (`benchmarks/sampler.py`, figures in docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxrunner.config import Kernels
from pallas_kernels.sampler_tally import NUM_CANDIDATES, ordered_keys, padded_vocab, tally_kernel, tally_reference

Tally = Callable[[jax.Array, jax.Array, jax.Array, bool], jax.Array]


def top_k_top_p(x: jax.Array, top_k: jax.Array, top_p: jax.Array, kernels: Kernels) -> jax.Array:
    """x [B, V] with every token outside each row's top-k, then top-p, set to -inf.

    top_k i32 [B] (V: off), top_p f32 [B] (1: off). x must be NaN-free.
    """
    vocab = x.shape[1]
    if kernels.pallas:
        padded = jnp.pad(x, ((0, 0), (0, padded_vocab(vocab) - vocab)), constant_values=-jnp.inf)
        tally: Tally = functools.partial(tally_kernel, padded, interpret=kernels.interpret)
    else:
        tally = functools.partial(tally_reference, x)
    keys = ordered_keys(x)
    key_min, key_max = jnp.min(keys, axis=1), jnp.max(keys, axis=1)
    row_max = jnp.max(x, axis=1)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)

    t_k = largest_satisfying(
        key_min,
        jnp.where(top_k < vocab, key_max, key_min),
        lambda cand: tally(cand, key_min, row_max, False) >= top_k[:, None],
    )
    kept_mass = jnp.sum(jnp.where(keys >= t_k[:, None], jnp.exp(x - row_max[:, None]), 0.0), axis=1)
    t_p = largest_satisfying(
        t_k,
        jnp.where(top_p < 1.0, key_max, t_k),
        lambda cand: tally(cand, t_k, row_max, True) >= (top_p * kept_mass)[:, None],
    )
    return jnp.where(keys >= t_p[:, None], x, -jnp.inf)


def largest_satisfying(lo: jax.Array, hi: jax.Array, satisfied: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """Per row, the largest key t in [lo, hi] (i32 [B]) with satisfied(t).

    `satisfied` maps candidate keys i32 [B, NUM_CANDIDATES] to bool of the same shape; it must
    hold at lo and be monotone (true up to the answer, false above it). The interval arithmetic
    runs on the keys shifted to u32, where hi - lo cannot overflow.
    """
    fractions = jnp.arange(1, NUM_CANDIDATES + 1, dtype=jnp.uint32)

    def narrow(_, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds
        width = hi - lo
        step = width // (NUM_CANDIDATES + 1) + 1
        cand = lo[:, None] + jnp.minimum(step[:, None] * fractions, width[:, None])
        ok = satisfied(_to_key(cand))
        live = width[:, None] > 0
        return (
            jnp.max(jnp.where(ok & live, cand, lo[:, None]), axis=1),
            jnp.min(jnp.where(~ok & live, cand - 1, hi[:, None]), axis=1),
        )

    num_passes = math.ceil(32 / math.log2(NUM_CANDIDATES + 1))
    return _to_key(lax.fori_loop(0, num_passes, narrow, (_to_unsigned(lo), _to_unsigned(hi)))[0])


def _to_unsigned(key: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(key, jnp.uint32) ^ jnp.uint32(0x80000000)


def _to_key(u: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(u ^ jnp.uint32(0x80000000), jnp.int32)
