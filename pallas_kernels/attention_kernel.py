"""The Pallas (Triton-lowered) kernel behind ragged paged attention.

One program handles one *work item* for one KV head and one KV split:

- a work item is up to `block_q` consecutive query tokens of one sequence (built by
  `ragged_paged_attention.work_list`); its rows are (token, query head of this KV head's group)
  pairs, so the K/V tile loaded for a KV head is used by every query head of its GQA group and by
  every token of the block: `rows = block_q * padded_group` (>= 16, the smallest Triton dot);
- keys are visited `block_k` at a time; each key's page comes from the block table, so a K tile is
  a gather of `block_k` rows of `head_dim` contiguous elements (one cache row per key);
- with `num_splits > 1` (flash-decoding) the key range is cut into that many chunks of at least
  `min_split_blocks * block_k` keys, each program writes an un-normalised partial (output and
  log-sum-exp) and `common.combine_splits` merges them.

The key loop runs in three phases: blocks cut by the sliding window's lower edge (masked), blocks
every row sees whole (no mask, no load predicate: the bulk of a long context), and blocks cut by
the causal diagonal or the end of the context (masked); `one_loop` runs them all masked, in one
loop, so that a row's arithmetic does not follow where its work item starts. Masked K/V loads read
zeros past the context and before the window, so unwritten cache rows never reach the output (even
NaN ones), nor do the pages a sliding group gave back, which may hold another request's keys by now.

Everything indexes with explicit integer arrays (pointer arithmetic under Triton), which the Triton
lowering and interpret mode both accept; interpret mode runs the same kernel on CPU for tests.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static tiling. `block_q * padded_group`, `block_k` and `head_dim` must be powers of two."""

    block_q: int
    block_k: int
    num_splits: int = 1
    min_split_blocks: int = 1
    num_warps: int = 4
    num_stages: int = 2
    one_loop: bool = False  # every block through the masked loop (batch invariance: `_kernel`)


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """What the kernel computes (static)."""

    sm_scale: float
    group: int
    padded_group: int
    sliding_window: int | None
    soft_cap: float | None


def _kernel(work_ref, q_ref, k_ref, v_ref, bt_ref, *out_refs, spec: AttentionSpec, cfg: KernelConfig,
            num_work: int):
    # Heavy (late, long) work items are at the end of the list: launch them first.
    w = num_work - 1 - pl.program_id(0)
    kv_head = pl.program_id(1)
    split = pl.program_id(2)
    seq = work_ref[w, 0]
    q_start = work_ref[w, 1]
    q_end = work_ref[w, 2]
    pos0 = work_ref[w, 3]  # sequence position of token q_start

    gp = spec.padded_group
    rows = cfg.block_q * gp
    head_dim = q_ref.shape[2]
    block_size = k_ref.shape[1]
    page_shift = block_size.bit_length() - 1
    max_pages = bt_ref.shape[1]
    bk = cfg.block_k

    r = jnp.arange(rows, dtype=jnp.int32)
    tok = q_start + r // gp
    g = r % gp
    head = kv_head * spec.group + g
    row_ok = (tok < q_end) & (g < spec.group)
    pos = pos0 + r // gp
    d = jnp.arange(head_dim, dtype=jnp.int32)[None, :]
    q = plt.load(q_ref.at[tok[:, None], head[:, None], d], mask=row_ok[:, None], other=0)

    # Keys this block needs: [kv_lo, kv_hi), kv_hi = 1 + position of its last token.
    n_q = q_end - q_start
    kv_hi = pos0 + n_q
    pos_last = kv_hi - 1
    if spec.sliding_window is None:
        kv_lo = 0
    else:
        kv_lo = jnp.maximum(pos0 - spec.sliding_window + 1, 0)
    blk_lo = kv_lo // bk
    blk_hi = jnp.maximum((kv_hi + bk - 1) // bk, blk_lo)
    if cfg.num_splits == 1:
        b0, b1 = blk_lo, blk_hi
    else:
        per = jnp.maximum((blk_hi - blk_lo + cfg.num_splits - 1) // cfg.num_splits, cfg.min_split_blocks)
        b0 = jnp.minimum(blk_lo + split * per, blk_hi)
        b1 = jnp.minimum(b0 + per, blk_hi)
    # Whole blocks: every key <= pos0 (visible to every row) and, with a window, >= pos_last - W + 1.
    # Which blocks those are follows where the work item starts, so with `one_loop` every block takes
    # the masked loop: two loops are two compiled bodies, whose products may contract differently.
    if spec.sliding_window is None or cfg.one_loop:
        u0 = b0
    else:
        u0 = jnp.clip((pos_last - spec.sliding_window + 1 + bk - 1) // bk, b0, b1)
    u1 = u0 if cfg.one_loop else jnp.clip((pos0 + 1) // bk, u0, b1)

    # fp32 caches get true fp32 products (Triton would use TF32 by default).
    precision = lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None
    score_scale = spec.sm_scale if spec.soft_cap is not None else spec.sm_scale * LOG2E

    def visit(blk, carry, masked: bool):
        acc, m, l = carry
        j = blk * bk + jnp.arange(bk, dtype=jnp.int32)
        # j >= 0 and block_size is a power of two: shift and mask instead of floor division.
        page = bt_ref[seq, jnp.minimum(j >> page_shift, max_pages - 1)]
        idx = (page[:, None], (j & (block_size - 1))[:, None], kv_head, d)
        if masked:
            key_ok = ((j >= kv_lo) & (j < kv_hi))[:, None]
            k = plt.load(k_ref.at[idx], mask=key_ok, other=0.0)
            v = plt.load(v_ref.at[idx], mask=key_ok, other=0.0)
        else:
            k = plt.load(k_ref.at[idx])
            v = plt.load(v_ref.at[idx])
        if k_ref.dtype != q_ref.dtype:  # fp8 pages, widened as they are read (their scales are the caller's)
            k, v = k.astype(q_ref.dtype), v.astype(q_ref.dtype)
        s = _dot(q, k, contract_b=1, precision=precision) * score_scale
        if spec.soft_cap is not None:
            s = jnp.tanh(s * (1.0 / spec.soft_cap)) * (spec.soft_cap * LOG2E)
        if masked:
            visible = j[None, :] <= pos[:, None]
            if spec.sliding_window is not None:
                visible &= j[None, :] > pos[:, None] - spec.sliding_window
            s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row that has seen no key yet
        p = jnp.exp2(s - m_safe[:, None])
        alpha = jnp.exp2(m - m_safe)
        l = l * alpha + p.sum(axis=1)
        acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v, contract_b=0, precision=precision)
        return acc, m_new, l

    carry = (jnp.zeros((rows, head_dim), jnp.float32),
             jnp.full((rows,), -jnp.inf, jnp.float32),
             jnp.zeros((rows,), jnp.float32))
    if spec.sliding_window is not None:
        carry = lax.fori_loop(b0, u0, functools.partial(visit, masked=True), carry)
    carry = lax.fori_loop(u0, u1, functools.partial(visit, masked=False), carry)
    acc, m, l = lax.fori_loop(u1, b1, functools.partial(visit, masked=True), carry)

    out = acc / jnp.where(l == 0.0, 1.0, l)[:, None]
    out_idx = (tok[:, None], head[:, None], d)
    if cfg.num_splits == 1:
        (o_ref,) = out_refs
        plt.store(o_ref.at[out_idx], out.astype(o_ref.dtype), mask=row_ok[:, None])
    else:
        o_ref, lse_ref = out_refs
        lse = jnp.where(l == 0.0, -jnp.inf, m + jnp.log2(jnp.where(l == 0.0, 1.0, l)))
        plt.store(o_ref.at[(split, *out_idx)], out, mask=row_ok[:, None])
        plt.store(lse_ref.at[split, tok, head], lse, mask=row_ok)


def _dot(a, b, *, contract_b: int, precision):
    """a @ b (contract_b=0) or a @ b.T (contract_b=1), accumulated in fp32."""
    return lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def paged_attention_call(work, q, k_cache, v_cache, block_tables, *, spec: AttentionSpec,
                         cfg: KernelConfig, interpret: bool, into: jax.Array | None = None):
    """Launch the kernel over `work` ([num_work, 4] int32: seq, q_start, q_end, pos0).

    Returns the output [T, Hq, D] (dtype of q) when `cfg.num_splits == 1`, else the partials
    (out [splits, T, Hq, D] f32, normalised per split; lse [splits, T, Hq] f32, base 2).
    `into` (unsplit only): an output [T, Hq, D] whose rows outside `work` are kept (its buffer is
    written in place).
    """
    num_work = work.shape[0]
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if cfg.num_splits == 1:
        out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    else:
        out_shape = (jax.ShapeDtypeStruct((cfg.num_splits, *q.shape), jnp.float32),
                     jax.ShapeDtypeStruct((cfg.num_splits, num_tokens, num_q_heads), jnp.float32))
    kernel = functools.partial(_kernel, spec=spec, cfg=cfg, num_work=num_work)
    operands, aliases = (work, q, k_cache, v_cache, block_tables), {}
    if into is not None:
        if cfg.num_splits != 1 or into.shape != q.shape or into.dtype != q.dtype:
            raise ValueError(f"paged_attention_call writes into a {q.dtype}{q.shape} output, unsplit; got "
                             f"{into.dtype}{into.shape} with {cfg.num_splits} splits")
        operands, aliases = (*operands, into), {len(operands): 0}
        kernel = functools.partial(_drop_into, kernel)
    return pl.pallas_call(
        kernel,
        grid=(num_work, num_kv_heads, cfg.num_splits),
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        input_output_aliases=aliases,
        name=f"ragged_paged_attention_q{cfg.block_q}_k{cfg.block_k}_s{cfg.num_splits}{'_one_loop' * cfg.one_loop}",
    )(*operands)


def _drop_into(kernel, work_ref, q_ref, k_ref, v_ref, bt_ref, _into_ref, out_ref):
    """`kernel` with the aliased `into` input left out: its buffer is `out_ref`."""
    kernel(work_ref, q_ref, k_ref, v_ref, bt_ref, out_ref)
