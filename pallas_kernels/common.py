"""Small helpers shared by the kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp


FP8 = jnp.dtype(jnp.float8_e4m3fn)  # the fp8 KV cache's format (e4m3, no infinities, +-448)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (Triton-lowered blocks must be powers of two)."""
    return 1 << max(0, (n - 1).bit_length())


def cdiv(a, b):
    """Ceiling division; works on Python ints and on traced integer arrays alike."""
    return (a + b - 1) // b


def combine_splits(out: jax.Array, lse: jax.Array) -> jax.Array:
    """Merge flash-decoding partials: `out` [splits, T, Hq, D] (each split normalised on its own)
    and `lse` [splits, T, Hq] (base-2 log-sum-exp, -inf for a split that saw no key)."""
    m = lse.max(axis=0)
    w = jnp.exp2(lse - jnp.where(m == -jnp.inf, 0.0, m))
    den = w.sum(axis=0)
    num = jnp.einsum("sthd,sth->thd", out, w, precision=jax.lax.Precision.HIGHEST)
    return num / jnp.where(den == 0.0, 1.0, den)[..., None]


def tree_sum(x: jax.Array) -> jax.Array:
    """The sum over x's last axis as a fixed tree of elementwise adds (zero-padded to a power of two,
    then halves added pairwise): each row's order of additions follows the row's length only, where
    a reduction's order is chosen by the whole array's shape (on the CPU a row of a [T, 16, 128]
    RMSNorm changes with T)."""
    width = next_pow2(x.shape[-1])
    x = jnp.pad(x, ((0, 0),) * (x.ndim - 1) + ((0, width - x.shape[-1]),))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]
