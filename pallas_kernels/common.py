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


def plan_tiles(group_sizes: jax.Array, num_rows: int, block_m: int) -> jax.Array:
    """i32 [min(ceil(M / block_m) + E, M), 3]: each tile of the grouped matmuls' rows, `block_m` rows
    of one group (a group's last tile partial), as its group (-1: unused), first row and the group's
    end row. Used tiles come first; every one holds a row, so there are at most M of them. The
    searches compare every pair (E is small): the default binary search is a while loop, several
    launches an iteration on a GPU, in every MoE layer."""
    sizes = group_sizes.astype(jnp.int32)
    num_groups = sizes.shape[0]
    tiles = cdiv(sizes, block_m)
    tile_end = jnp.cumsum(tiles)
    row_start = jnp.cumsum(sizes) - sizes
    i = jnp.arange(min(cdiv(num_rows, block_m) + num_groups, num_rows), dtype=jnp.int32)
    group = jnp.searchsorted(tile_end, i, side="right", method="compare_all").astype(jnp.int32)
    g = jnp.minimum(group, num_groups - 1)
    first = row_start[g] + (i - (tile_end[g] - tiles[g])) * block_m
    return jnp.stack([jnp.where(group < num_groups, group, -1), first, row_start[g] + sizes[g]], axis=1)


def tile_major_rows(group_sizes: jax.Array, num_rows: int, block_m: int) -> tuple[jax.Array, jax.Array]:
    """(i32 [M], bool [M]): each row's place in an output laid out tile by tile as `plan_tiles`
    plans them (`block_m` rows a tile), and whether the row belongs to a group at all."""
    sizes = group_sizes.astype(jnp.int32)
    tiles = cdiv(sizes, block_m)
    group_end = jnp.cumsum(sizes)
    r = jnp.arange(num_rows, dtype=jnp.int32)
    g = jnp.minimum(jnp.searchsorted(group_end, r, side="right", method="compare_all"), sizes.shape[0] - 1)
    offset = r - (group_end[g] - sizes[g])
    place = (jnp.cumsum(tiles)[g] - tiles[g] + offset // block_m) * block_m + offset % block_m
    valid = r < group_end[-1]
    return jnp.where(valid, place, 0), valid
