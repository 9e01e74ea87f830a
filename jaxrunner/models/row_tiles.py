"""Rows whose results do not depend on the batch: `RunnerConfig.batch_invariant`.

XLA picks a matmul's algorithm, and with it the order its sums run in, by the shapes it is given:
the same row of activations times the same weight can come out with other low bits when the batch
around it has more or fewer rows (on the CPU already between 1, 2 and 64 rows), and a row's
reduction (a softmax's sum) differs between one row and several. Cut into tiles of a fixed number
of rows and run one tile at a time (a loop, which XLA does not fuse back into one call), every row
goes through a call of one shape, so its bits depend on its own values only: neither on the batch
size nor on its position in the batch. There are always two tiles at least: XLA inlines a loop of
one round, whose body then fuses with what surrounds it, and its sums change. Each tile of a
product reads the whole weight, so on a GPU the projections run a kernel's fixed tiles instead
(`fixed_tile_matmul`). Split over devices, partial sums are added in device order
(`summed_in_order`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul import grouped_matmul, k_ranges, supported

TILE_ROWS = 8
# The grouped matmul's rows per tile, batch-invariant (an MoE MLP's experts: `step.moe_matmul`; a
# projection on a GPU: `fixed_tile_matmul`): a fixed shape, as TILE_ROWS, but each tile reads its
# weights, so it is larger: the weights are read once per 64 rows.
GROUPED_TILE_ROWS = 64


def row_tiled(f: Callable, rows, *whole):
    """f(rows, *whole) computed TILE_ROWS rows at a time: `rows` a pytree whose arrays all have the
    same M rows first (padded with zero rows to whole tiles), `whole` passed to every call as it is."""
    m = jax.tree.leaves(rows)[0].shape[0]
    count = max(-(-m // TILE_ROWS), 2)  # a loop of one round is inlined, and then fused otherwise

    def tiles(a: jax.Array) -> jax.Array:  # (shapes spelled out: a zero-width array has no -1 to infer)
        padded = jnp.pad(a, ((0, count * TILE_ROWS - m),) + ((0, 0),) * (a.ndim - 1))
        return padded.reshape(count, TILE_ROWS, *a.shape[1:])

    out = jax.lax.map(lambda tile: f(tile, *whole), jax.tree.map(tiles, rows))
    return jax.tree.map(lambda a: a.reshape(count * TILE_ROWS, *a.shape[2:])[:m], out)


def fixed_tile_matmul(matmul: Callable, x: jax.Array, w, *, interpret: bool, transposed: bool = False,
                      out_dtype=None) -> jax.Array:
    """x [M, K] @ w [K, N] (w [N, K] when `transposed`) with each row's bits its own, for a GPU: the
    Pallas grouped matmul with one group, in tiles of GROUPED_TILE_ROWS rows, K summed in the ranges
    `tiling` fixes from the weight's shape, so a row's sums have one order whatever M is, and the
    weight is read once per tile, where `row_tiled` reads it once per TILE_ROWS rows in a loop. Few
    tiles (a decode) spread the ranges over programs of their own: same bits, more SMs streaming.
    Weights it does not take (quantized, a shape it does not support, or split over devices: the
    partitioner cannot split a kernel) go through `row_tiled(matmul, ...)`; `matmul(x, w)` must give
    `out_dtype` (default x's)."""
    mesh = jax.sharding.get_abstract_mesh()
    if isinstance(w, jax.Array) and (mesh.empty or mesh.size == 1):
        k, n = w.shape[::-1] if transposed else w.shape
        if supported(k, n):
            block_n, block_k, k_splits = tiling(k, n, x.dtype.itemsize)
            programs = (-(-x.shape[0] // GROUPED_TILE_ROWS) + 1) * (n // block_n)  # the grid's, with its spare tile
            return grouped_matmul(x, w[None], jnp.full((1,), x.shape[0], jnp.int32), interpret=interpret,
                                  block_m=GROUPED_TILE_ROWS, block_n=block_n, block_k=block_k, k_splits=k_splits,
                                  spread_splits=k_splits > 1 and programs < SPREAD_BELOW, rhs_transposed=transposed,
                                  out_dtype=out_dtype)
    return row_tiled(matmul, x, w)


# Programs below which `fixed_tile_matmul` gives each K range a program: about two per SM of an H200.
SPREAD_BELOW = 256


def tiling(k: int, n: int, itemsize: int) -> tuple[int, int, int]:
    """`fixed_tile_matmul`'s column block (up to 128), K step (64 rows of bf16, as much shared memory
    for float32) and K ranges: as many as bring one tile of rows to SPREAD_BELOW programs. All
    follow the weight's shape only, never the batch's, so a row's bits stay its own."""
    block_n = math.gcd(n, 128)
    block_k = math.gcd(k, 128 // itemsize)
    return block_n, block_k, k_ranges(k, block_k, n // block_n, SPREAD_BELOW)


def per_row(f: Callable, rows, tiled: bool):
    """f(rows), computed a tile of rows at a time when `tiled` (`row_tiled`)."""
    return row_tiled(f, rows) if tiled else f(rows)


def summed_in_order(partial: jax.Array, axis: str) -> jax.Array:
    """The sum of every device's `partial` over the mesh axis `axis` (inside a `shard_map`), added in
    device order: an all-reduce adds in the order its algorithm takes, and NCCL picks the algorithm
    by the message's size, so by the batch's. It moves t - 1 partials into each device, as many
    bytes as a ring all-reduce at t = 2."""
    parts = jax.lax.all_gather(partial, axis)
    return functools.reduce(jnp.add, [parts[i] for i in range(parts.shape[0])])
