"""A grouped matmul for the Mixture-of-Experts MLP as a Pallas (Triton) kernel: `jax.lax.ragged_dot`'s
function, reading only the groups' own weights.

`lhs` [M, K] holds rows sorted by group, group g owning `group_sizes[g]` rows after those of the
groups before it (rows past them all come out zero); row r of group g is `lhs[r] @ rhs[g]`. XLA's
`ragged_dot` on the GPU reads every group's `rhs` whatever the sizes, so a decode step that uses 8
experts of 128 streams all of them (docs/benchmarks.md). Here the rows are cut into tiles of
`block_m` rows of one group (a group's last tile is partial), and program (tile, column block)
multiplies its tile by its group's column block: each used group's weights are read once per tile,
an empty group's never. The tiles are planned on the device (`common.plan_tiles`: a tile count
that depends only on the shapes covers every split); unused tiles return at once. `block_m` grows
with the rows per group (16 for a decode's few copies per expert, up to 128 for a prefill,
whose tiles would otherwise re-read each expert's weights many times), or is fixed by the caller:
then a row's products run in tiles of one shape whatever the batch routes beside it, which batch
invariance needs (`grouped_matmul_in_tiles` computes the same tiles through XLA).

K can be cut into `k_splits` ranges, each summed from zero and then added in order ((r0 + r1) + r2
...): an order the caller fixes from the weight's shape alone. With `spread_splits` every range is
a program of its own and writes float32 partial sums, which XLA adds in that same order after the
kernel: a decode's one tile of rows then has programs enough to stream a narrow weight with every
SM, and gives the bits the ranges give in one program.

Triton wants power-of-two blocks and dots of K >= 16: K and N must be multiples of 16 (`supported`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.common import cdiv, next_pow2, plan_tiles

MIN_RANGE = 256  # rows of K a range sums at least


def supported(k: int, n: int) -> bool:
    return k % 16 == 0 and n % 16 == 0


def k_ranges(k: int, block_k: int, programs: int, wanted: int) -> int:
    """K ranges that bring `programs` (tiles x column blocks) up to `wanted`: a power of two, each
    range whole steps of `block_k` and at least MIN_RANGE deep."""
    splits = 1
    while programs * splits < wanted and k % (2 * splits * block_k) == 0 and k // (2 * splits) >= MIN_RANGE:
        splits *= 2
    return splits


def block_rows(num_rows: int, num_groups: int) -> int:
    """Rows per tile: about the rows of a group, a power of two in [16, 128]."""
    return min(128, max(16, next_pow2(num_rows // num_groups)))


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, interpret: bool = False,
                   block_m: int = 0, block_n: int = 0, block_k: int = 0, k_splits: int = 1,
                   spread_splits: bool = False, min_programs: int = 0, rhs_transposed: bool = False,
                   out_dtype=None) -> jax.Array:
    """[M, N] in `out_dtype` (default lhs's) for lhs [M, K], rhs [E, K, N] ([E, N, K] when
    `rhs_transposed`: a tied LM head is the embedding [vocab, hidden] as it is held), group_sizes
    [E] (as `ragged_dot`), in tiles of `block_m` rows (0: `block_rows`) by `block_n` columns (0: up
    to 128), K `block_k` at a time (0: up to 64) in `k_splits` ranges (`spread_splits`: a program
    each). `min_programs`: where the fewest tiles the rows can fill give fewer programs (a decode's
    few rows), K is cut into ranges (`k_ranges`), a program each, so that every SM streams weights;
    the sums' order then follows M."""
    num_rows, k = lhs.shape
    num_groups, k_rhs, n = (rhs.shape[0], rhs.shape[2], rhs.shape[1]) if rhs_transposed else rhs.shape
    if k_rhs != k or not supported(k, n):
        raise ValueError(f"grouped_matmul cannot run lhs {lhs.shape} by rhs {rhs.shape}: it needs K and N in "
                         "multiples of 16")
    for name, size in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if size and (size < 16 or size != next_pow2(size)):
            raise ValueError(f"grouped_matmul takes tiles of a power of two, 16 or more, a side, got {name}={size}")
    for name, size, whole in (("block_n", block_n, n), ("block_k", block_k, k)):
        if size and whole % size:
            raise ValueError(f"grouped_matmul's {name}={size} does not divide {whole}")
    block_m = block_m or block_rows(num_rows, num_groups)
    plan = plan_tiles(group_sizes, num_rows, block_m)
    block_n, block_k = block_n or math.gcd(n, 128), block_k or math.gcd(k // k_splits, 64)
    if min_programs and k_splits == 1:
        # the fewest tiles the rows can fill: a decode bucket's rows are mostly padding at small batches
        k_splits = k_ranges(k, block_k, cdiv(num_rows, block_m) * (n // block_n), min_programs)
        spread_splits = k_splits > 1
    if k_splits < 1 or k % (k_splits * block_k):
        raise ValueError(f"grouped_matmul cannot cut K={k} into k_splits={k_splits} ranges of whole "
                         f"block_k={block_k} steps")
    out_dtype = out_dtype or lhs.dtype
    splits = (k_splits,) if spread_splits else ()
    name = f"grouped_matmul_m{block_m}_n{block_n}_k{block_k}"
    if k_splits > 1:
        name += f"_s{k_splits}" + ("_spread" if spread_splits else "")
    out = pl.pallas_call(
        functools.partial(_kernel, block_m=block_m, block_n=block_n, block_k=block_k, k_splits=k_splits,
                          rhs_transposed=rhs_transposed),
        grid=(plan.shape[0], n // block_n, *splits),
        out_shape=jax.ShapeDtypeStruct((*splits, num_rows, n), jnp.float32 if splits else out_dtype),
        compiler_params=plt.CompilerParams(num_warps=4 if min(block_m, block_n) <= 32 else 8, num_stages=3),
        interpret=interpret,
        name=name,
    )(plan, lhs, rhs)
    if splits:  # the ranges' sums added in the order one program adds them
        out = functools.reduce(jnp.add, [out[r] for r in range(k_splits)]).astype(out_dtype)
    total = jnp.sum(group_sizes)
    return jnp.where((jnp.arange(num_rows) < total)[:, None], out, jnp.zeros((), out.dtype))


def grouped_matmul_in_tiles(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, block_m: int) -> jax.Array:
    """`grouped_matmul`'s tiles of `block_m` rows through XLA, one tile at a time (as many as the
    groups fill): every row's product has one shape whatever the batch, where `ragged_dot`'s depend
    on the rows beside it."""
    num_rows = lhs.shape[0]
    plan = plan_tiles(group_sizes, num_rows, block_m)
    padded = jnp.pad(lhs, ((0, block_m), (0, 0)))

    def tile(i: jax.Array, out: jax.Array) -> jax.Array:
        group, first, end = plan[i, 0], plan[i, 1], plan[i, 2]
        product = jax.lax.dynamic_slice_in_dim(padded, first, block_m) @ rhs[group]
        keep = (first + jnp.arange(block_m) < end)[:, None]
        held = jax.lax.dynamic_slice_in_dim(out, first, block_m)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(keep, product.astype(out.dtype), held), first, 0)

    used = jnp.sum(cdiv(group_sizes.astype(jnp.int32), block_m))
    out = jax.lax.fori_loop(0, used, tile, jnp.zeros((num_rows + block_m, rhs.shape[2]), lhs.dtype))
    return out[:num_rows]


def _kernel(plan_ref, lhs_ref, rhs_ref, out_ref, *, block_m: int, block_n: int, block_k: int, k_splits: int,
            rhs_transposed: bool):
    tile, col = pl.program_id(0), pl.program_id(1)
    spread = len(out_ref.shape) == 3
    split = pl.program_id(2) if spread else 0
    group, first, end = plan_ref[tile, 0], plan_ref[tile, 1], plan_ref[tile, 2]

    @pl.when(group >= 0)
    def _():
        rows = first + jnp.arange(block_m, dtype=jnp.int32)
        ok = rows < end
        cols = col * block_n + jnp.arange(block_n, dtype=jnp.int32)
        kk = jnp.arange(block_k, dtype=jnp.int32)
        precision = jax.lax.Precision.HIGHEST if lhs_ref.dtype == jnp.float32 else None

        def step(i, acc):
            ks = i * block_k + kk
            a = plt.load(lhs_ref.at[rows[:, None], ks[None, :]], mask=ok[:, None], other=0.0)
            if rhs_transposed:
                b = plt.load(rhs_ref.at[group, cols[:, None], ks[None, :]])
                product = jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                                              preferred_element_type=jnp.float32)
            else:
                product = jax.lax.dot(a, plt.load(rhs_ref.at[group, ks[:, None], cols[None, :]]), precision=precision,
                                      preferred_element_type=jnp.float32)
            return acc + product

        steps = lhs_ref.shape[1] // (k_splits * block_k)  # per range

        def range_sum(first):
            return jax.lax.fori_loop(first, first + steps, step, jnp.zeros((block_m, block_n), jnp.float32))

        if spread:
            plt.store(out_ref.at[split, rows[:, None], cols[None, :]], range_sum(split * steps), mask=ok[:, None])
        else:
            acc = range_sum(0)
            for r in range(1, k_splits):
                acc = acc + range_sum(r * steps)
            plt.store(out_ref.at[rows[:, None], cols[None, :]], acc.astype(out_ref.dtype), mask=ok[:, None])
