"""Decode attention for Hopper through Mosaic GPU: TMA page copies, wgmma, a warp-specialised pipeline.

EXPERIMENTAL: written against the jax 0.11.2 source and checked in Mosaic GPU interpret mode on
CPU only; it has not yet been compiled on an H200. `ragged_paged_attention_decode(impl="mosaic")`
selects it, and `benchmarks/attention.py` measures it next to the Triton-lowered kernel, which
stays the default until a measurement says otherwise.

Why a second kernel: decode is a stream of K/V pages through the SM. Here the copy engine (TMA)
moves each page (`block_size` rows of one KV head) into shared memory on its own, a separate
warpgroup keeps `stages` blocks of `block_k` keys in flight, and the compute warpgroup runs the two
products on the tensor cores (wgmma), so no thread spends registers or issue slots on addresses.

One program per (sequence, KV head, KV split):
- its query rows are the `queries_per_seq * group` (token, query head) pairs of that KV head, padded
  in XLA to a multiple of 8 and copied into the first rows of a 64-row tile (wgmma's M). Rows past
  them hold whatever shared memory held: rows never mix in attention, and only the real rows are
  written back;
- keys [b0 * block_k, b1 * block_k) of its split; a block past the context re-reads the context's
  last page (masked), so no block-table entry past the context is ever used.

Preconditions (beyond the Triton kernel's): a uniform decode batch (sequence s < num_seqs owns
tokens [s * qps, (s + 1) * qps)); bf16 or f16; head_dim 64 or 128 (at 256 the two fp32 tiles of
the P @ V step would not fit the registers); qps * group <= 64; and
cache rows past each context hold finite values (true in the runner: a zero-initialised cache only
ever overwritten with K/V), since a masked probability of 0 times an inf/NaN row is NaN.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import cdiv, combine_splits

LOG2E = math.log2(math.e)
TILE_ROWS = 64  # wgmma M


@dataclasses.dataclass(frozen=True)
class MosaicDecodeConfig:
    block_k: int = 64
    stages: int = 3
    num_splits: int = 1
    min_split_blocks: int = 8


def default_mosaic_config(num_splits: int, min_split_keys: int) -> MosaicDecodeConfig:
    """64-key blocks, 3 stages: with D <= 128, about 150 KiB of shared memory."""
    return MosaicDecodeConfig(block_k=64, stages=3, num_splits=num_splits,
                              min_split_blocks=max(1, min_split_keys // 64))


def mosaic_decode_attention(q, k_cache, v_cache, seq_lens, block_tables, num_seqs, *, sm_scale: float,
                            queries_per_seq: int, sliding_window: int | None, soft_cap: float | None,
                            cfg: MosaicDecodeConfig, interpret: bool = False) -> jax.Array:
    """Uniform-decode attention; same result as `ragged_paged_attention` on such a batch."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    qps = queries_per_seq
    rows = qps * group
    rows8 = cdiv(rows, 8) * 8
    if rows8 > TILE_ROWS or head_dim not in (64, 128) or q.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"mosaic decode needs qps*group <= 64, head_dim 64 or 128, bf16/f16; got "
                         f"{qps}*{group}, {head_dim}, {q.dtype}")
    num_slots = min(block_tables.shape[0], num_tokens // qps)

    # [S, Hkv, rows8, D]: row i * group + g is token i's query head (kv_head * group + g).
    q_tiles = q[: num_slots * qps].reshape(num_slots, qps, num_kv_heads, group, head_dim)
    q_tiles = q_tiles.transpose(0, 2, 1, 3, 4).reshape(num_slots, num_kv_heads, rows, head_dim)
    q_tiles = jnp.pad(q_tiles, ((0, 0), (0, 0), (0, rows8 - rows), (0, 0)))
    kv_lens = jnp.where(jnp.arange(num_slots) < num_seqs, seq_lens[:num_slots], 0).astype(jnp.int32)
    tables = block_tables[:num_slots].astype(jnp.int32)

    splits = cfg.num_splits
    out_dtype = q.dtype if splits == 1 else jnp.float32
    out_shape = [jax.ShapeDtypeStruct((splits, num_slots, num_kv_heads, rows8, head_dim), out_dtype)]
    if splits > 1:
        out_shape.append(jax.ShapeDtypeStruct((splits, num_slots, num_kv_heads, TILE_ROWS), jnp.float32))

    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    p_swizzle = min(128, cfg.block_k * 2)  # bytes in a row of P, up to the 128-byte swizzle
    kv_tile = (cfg.stages, cfg.block_k, head_dim)
    scratch = [
        plgpu.SMEM((TILE_ROWS, head_dim), q.dtype, transforms=transforms),
        plgpu.SMEM(kv_tile, q.dtype, transforms=transforms),
        plgpu.SMEM(kv_tile, q.dtype, transforms=transforms),
        plgpu.SMEM((TILE_ROWS, cfg.block_k), q.dtype, transforms=(
            plgpu.TilingTransform((8, p_swizzle // 2)), plgpu.SwizzleTransform(p_swizzle))),
        plgpu.SMEM((TILE_ROWS, head_dim), out_dtype),
        plgpu.SMEM((TILE_ROWS,), jnp.float32),
        plgpu.Barrier(num_arrivals=1),
        plgpu.Barrier(num_arrivals=max(1, cfg.block_k // block_size), num_barriers=cfg.stages),
        plgpu.Barrier(num_arrivals=max(1, cfg.block_k // block_size), num_barriers=cfg.stages),
        plgpu.Barrier(num_arrivals=1, num_barriers=cfg.stages),
        plgpu.Barrier(num_arrivals=1, num_barriers=cfg.stages),
    ]
    body = functools.partial(
        _kernel, cfg=cfg, qps=qps, group=group, rows8=rows8, sm_scale=float(sm_scale),
        sliding_window=sliding_window, soft_cap=None if soft_cap is None else float(soft_cap))
    outs = plgpu.kernel(
        body,
        out_type=out_shape,
        scratch_types=scratch,
        grid=(num_slots, num_kv_heads, splits),
        grid_names=("seq", "head", "split"),
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(q_tiles, k_cache, v_cache, tables, kv_lens)

    # Back to [splits, S * qps, Hq, D] token-major rows.
    out = outs[0][:, :, :, :rows].reshape(splits, num_slots, num_kv_heads, qps, group, head_dim)
    out = out.transpose(0, 1, 3, 2, 4, 5).reshape(splits, num_slots * qps, num_q_heads, head_dim)
    if splits == 1:
        out = out[0]
    else:
        lse = outs[1][..., :rows].reshape(splits, num_slots, num_kv_heads, qps, group)
        lse = lse.transpose(0, 1, 3, 2, 4).reshape(splits, num_slots * qps, num_q_heads)
        out = combine_splits(out, lse).astype(q.dtype)
    return jnp.pad(out, ((0, num_tokens - num_slots * qps), (0, 0), (0, 0)))


def _kernel(q_ref, k_ref, v_ref, bt_ref, lens_ref, *refs, cfg: MosaicDecodeConfig, qps: int, group: int,
            rows8: int, sm_scale: float, sliding_window: int | None, soft_cap: float | None):
    if cfg.num_splits == 1:
        (o_ref,), scratch = refs[:1], refs[1:]
        lse_ref = None
    else:
        (o_ref, lse_ref), scratch = refs[:2], refs[2:]
    (q_smem, k_smem, v_smem, p_smem, o_smem, lse_smem,
     q_bar, k_bars, v_bars, k_free, v_free) = scratch
    seq = lax.axis_index("seq")
    head = lax.axis_index("head")
    split = lax.axis_index("split")
    block_size = k_ref.shape[1]
    max_pages = bt_ref.shape[1]
    bk, stages = cfg.block_k, cfg.stages

    ctx = lens_ref[seq]
    pos_first = ctx - qps  # position of the sequence's first query token
    kv_lo = 0 if sliding_window is None else jnp.maximum(pos_first - sliding_window + 1, 0)
    blk_lo = lax.div(kv_lo, bk)
    blk_hi = jnp.maximum(lax.div(ctx + bk - 1, bk), blk_lo)
    per = jnp.maximum(lax.div(blk_hi - blk_lo + cfg.num_splits - 1, cfg.num_splits), cfg.min_split_blocks)
    b0 = jnp.minimum(blk_lo + split * per, blk_hi)
    b1 = jnp.minimum(b0 + per, blk_hi)
    num_steps = b1 - b0
    last_page = jnp.maximum(lax.div(ctx + block_size - 1, block_size) - 1, 0)

    def issue(step):
        """Copy block b0 + step of K and V (one TMA per page, or part of a page) into its slot."""
        slot = lax.rem(step, stages)
        first_key = (b0 + step) * bk
        copies, copy_rows = max(1, bk // block_size), min(bk, block_size)
        for c in range(copies):
            key = first_key + c * copy_rows
            page = bt_ref[seq, jnp.minimum(jnp.minimum(lax.div(key, block_size), last_page), max_pages - 1)]
            src = (page, pl.ds(lax.rem(key, block_size), copy_rows), head)
            dst = pl.ds(c * copy_rows, copy_rows)
            plgpu.copy_gmem_to_smem(k_ref.at[src], k_smem.at[slot, dst], k_bars.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[src], v_smem.at[slot, dst], v_bars.at[slot])

    @pl.when(lax.axis_index("wg") == 1)
    def _memory():
        for step in range(stages):
            pl.when(step < num_steps)(functools.partial(issue, step))

        @pl.loop(stages, jnp.maximum(num_steps, stages))
        def _(step):
            slot = lax.rem(step, stages)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
            issue(step)

    @pl.when(lax.axis_index("wg") == 0)
    def _compute():
        plgpu.copy_gmem_to_smem(q_ref.at[seq, head], q_smem.at[pl.ds(0, rows8)], q_bar)
        plgpu.barrier_wait(q_bar)
        row = plgpu.broadcasted_iota(jnp.int32, (TILE_ROWS, bk), 0, layout=plgpu.Layout.WGMMA)
        col = plgpu.broadcasted_iota(jnp.int32, (TILE_ROWS, bk), 1, layout=plgpu.Layout.WGMMA)
        pos = pos_first + lax.div(row, group)
        score_scale = sm_scale if soft_cap is not None else sm_scale * LOG2E

        def visit(step, carry, masked: bool):
            acc, m, l = carry
            slot = lax.rem(step, stages)
            plgpu.barrier_wait(k_bars.at[slot])

            def qk_scope(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                return acc_ref[...]
            s = pl.run_scoped(qk_scope, plgpu.ACC((TILE_ROWS, bk), jnp.float32))
            plgpu.barrier_arrive(k_free.at[slot])
            s = s * score_scale
            if soft_cap is not None:
                s = jnp.tanh(s * (1.0 / soft_cap)) * (soft_cap * LOG2E)
            if masked:
                key = (b0 + step) * bk + col
                visible = key <= pos
                if sliding_window is not None:
                    visible = visible & (key > pos - sliding_window)
                s = jnp.where(visible, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
            alpha = jnp.exp2(m - m_safe)
            l = l * alpha + p.sum(axis=1)
            # P goes through shared memory (wgmma could take it from registers, but interpret
            # mode cannot); the fence makes the stores visible to the tensor cores.
            p_smem[...] = p.astype(p_smem.dtype)
            plgpu.commit_smem()
            plgpu.barrier_wait(v_bars.at[slot])

            def pv_scope(acc_ref):
                plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
                return acc_ref[...]
            pv = pl.run_scoped(pv_scope, plgpu.ACC(acc.shape, jnp.float32))
            plgpu.barrier_arrive(v_free.at[slot])
            return acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv, m_new, l

        head_dim = q_smem.shape[1]
        carry = (
            plgpu.layout_cast(jnp.zeros((TILE_ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((TILE_ROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
            plgpu.layout_cast(jnp.zeros((TILE_ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        )
        # Whole blocks need no mask: every key <= pos_first and, with a window, inside every
        # query's window. The rest (window edge, causal diagonal, context end) are masked.
        pos_last = ctx - 1
        if sliding_window is None:
            u0 = b0
        else:
            u0 = jnp.clip(lax.div(jnp.maximum(pos_last - sliding_window + bk, 0), bk), b0, b1)
            carry = lax.fori_loop(0, u0 - b0, functools.partial(visit, masked=True), carry)
        u1 = jnp.clip(lax.div(jnp.maximum(pos_first + 1, 0), bk), u0, b1)
        carry = lax.fori_loop(u0 - b0, u1 - b0, functools.partial(visit, masked=False), carry)
        acc, m, l = lax.fori_loop(u1 - b0, num_steps, functools.partial(visit, masked=True), carry)

        l_safe = jnp.where(l == 0.0, 1.0, l)
        o_smem[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(o_smem.dtype)
        if lse_ref is not None:
            lse_smem[...] = jnp.where(l == 0.0, -jnp.inf, m + jnp.log2(l_safe))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, rows8)], o_ref.at[split, seq, head])
        if lse_ref is not None:
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[split, seq, head])
        plgpu.wait_smem_to_gmem(0)
