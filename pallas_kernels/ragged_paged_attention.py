"""Ragged paged attention: one call for a packed batch of prefill chunks and decodes.

Inputs (the runner's attention contract, docs/design.md):
- `q` [T, Hq, D]: the step's query tokens, packed sequence after sequence;
- `k_cache`, `v_cache` [num_blocks, block_size, Hkv, D]: one layer's paged cache, already holding
  the KV of the step's tokens (`write_kv` runs first);
- `query_start_loc` int32 [S+1]: sequence s owns tokens [qsl[s], qsl[s+1]); padded with the total;
- `seq_lens` int32 [S]: context length of each sequence, the step's tokens included;
- `block_tables` int32 [S, max_blocks]: key j of sequence s lives in page `block_tables[s, j // bs]`;
- `num_seqs`: sequences >= num_seqs are padding; tokens past qsl[num_seqs] are padding (output 0).

Sequence s's queries are its last q_len tokens: query i sits at position seq_lens[s] - q_len + i
and sees keys j <= position (and j > position - sliding_window when set).

Two entry points share one kernel (`attention_kernel.py`) and differ only in static tiling:
- `ragged_paged_attention`: any mix; `block_q` tokens of one sequence per program (about 128 rows
  with the GQA group; 16 in batch-invariant steps): built for prefill chunks, correct for
  everything. No KV split, except in a short step over a long context (`prefill_config`);
- `ragged_paged_attention_decode`: the decode specialisation for a batch where no sequence has more
  than `queries_per_seq` query tokens (1, or 1 + k speculative drafts): one program per sequence and
  KV head with as few padded rows as the dot allows, and the context split across programs
  (flash-decoding) so that a small batch with a long context still fills the GPU. The runner calls
  it when the step is a uniform decode. Its splits depend on the GPU's SM count (`num_sms`).

Both take a `config` override (a `KernelConfig`) so benchmarks can sweep tilings.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.attention_kernel import AttentionSpec, KernelConfig, paged_attention_call
from pallas_kernels.common import FP8, cdiv, combine_splits, next_pow2, tree_sum

ALL_QUERIES = (0, 1 << 30)  # `work_list`'s default: sequences of any query count
MIN_SPLIT_KEYS = 512  # a flash-decoding split covers at least this many keys...
SHORT_SPLIT_KEYS = 128  # ...or, for a batch with fewer (sequence, KV head) pairs than SMs, this many
SHORT_STEP_TOKENS = 256  # a mixed step of at most this many tokens...
LONG_CONTEXT_KEYS = 4096  # ...over a context of at least this many keys splits it, in splits of...
PREFILL_SPLIT_KEYS = 1024  # ...at least this many keys, at most MAX_PREFILL_SPLITS of them
MAX_PREFILL_SPLITS = 16


def ragged_paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    query_start_loc: jax.Array,
    seq_lens: jax.Array,
    block_tables: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    interpret: bool = False,
    batch_invariant: bool = False,
    config: KernelConfig | None = None,
    queries: tuple[int, int] = ALL_QUERIES,
    into: jax.Array | None = None,
) -> jax.Array:
    """Attention for a packed ragged batch (prefill chunks and decodes mixed); returns [T, Hq, D].
    `batch_invariant`: `invariant_config`'s tiling. `queries`: only the sequences with [lo, hi)
    query tokens (the padding's tokens as one more sequence); the other tokens' rows are left
    unwritten, or as they are in `into` (another kernel's output for them, donated)."""
    spec = _spec(q, k_cache, v_cache, sm_scale, sliding_window, soft_cap)
    if batch_invariant:
        cfg = config or invariant_config(q.dtype, q.shape[2], spec.padded_group)
    else:  # split partials cannot go into another kernel's output: no split with `into`
        cfg = config or prefill_config(q.dtype, q.shape[2], spec.padded_group,
                                       num_tokens=q.shape[0] if into is None else 0,
                                       max_context=block_tables.shape[1] * k_cache.shape[1])
    return _attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, num_seqs,
                      spec=spec, cfg=cfg, interpret=interpret, queries=queries, into=into)


def ragged_paged_attention_decode(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    query_start_loc: jax.Array,
    seq_lens: jax.Array,
    block_tables: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    queries_per_seq: int = 1,
    num_sms: int,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    interpret: bool = False,
    config: KernelConfig | None = None,
) -> jax.Array:
    """The decode specialisation: every sequence has at most `queries_per_seq` query tokens.

    Same arguments and result as `ragged_paged_attention`; any batch is handled correctly (a
    sequence with more query tokens than `block_q` only gets a worse tiling). `num_sms`: the GPU's
    streaming multiprocessors, which the default tiling fills with KV splits.
    """
    spec = _spec(q, k_cache, v_cache, sm_scale, sliding_window, soft_cap)
    cfg = config or decode_config(
        q.dtype, q.shape[2], spec.padded_group, queries_per_seq=queries_per_seq,
        num_tokens=q.shape[0], num_kv_heads=k_cache.shape[2],
        max_context=block_tables.shape[1] * k_cache.shape[1], num_sms=num_sms)
    return _attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, num_seqs,
                      spec=spec, cfg=cfg, interpret=interpret)


def prefill_config(dtype, head_dim: int, padded_group: int, *, num_tokens: int = 0, max_context: int = 0) -> KernelConfig:
    """Tiling for mixed/prefill batches: ~128 query rows (64 for D=256 or fp32) x 64 keys, 4 warps
    (4 warps won the H200 sweep in docs/benchmarks.md).

    A step of at most SHORT_STEP_TOKENS `num_tokens` (a short chunk beside decodes: a revisited
    prefix's last message) over a `max_context` of LONG_CONTEXT_KEYS or more also splits the
    context, as the decode kernel does: unsplit, the chunk's few work items would each walk the
    whole context on one SM while the rest of the GPU idles. A sequence with fewer keys than a
    split's PREFILL_SPLIT_KEYS uses one split; the others' programs end at once."""
    big = head_dim > 128 or jnp.dtype(dtype) == jnp.float32
    rows = 64 if big else 128
    block_q = max(1, rows // padded_group)
    block_k = 32 if big else 64
    num_splits = 1
    if 0 < num_tokens <= SHORT_STEP_TOKENS and max_context >= LONG_CONTEXT_KEYS:
        num_splits = min(MAX_PREFILL_SPLITS, max_context // PREFILL_SPLIT_KEYS)
    return KernelConfig(block_q=block_q, block_k=block_k, num_splits=num_splits,
                        min_split_blocks=PREFILL_SPLIT_KEYS // block_k if num_splits > 1 else 1,
                        num_warps=4, num_stages=2 if big else 3)


def invariant_config(dtype, head_dim: int, padded_group: int) -> KernelConfig:
    """Tiling for batch-invariant steps, one for every batch: no KV split (the decode kernel's
    splits follow the batch's size), and tiles of 16 rows, the smallest dot, as the decode kernel's,
    so that a decode, which fills one row per query head, does not pay for the 128 rows of a
    prefill's tile; and every key block through one loop (`one_loop`). A row's keys are then
    visited in one order, by one compiled body, whatever the batch or the chunk around it; a
    prefill chunk pays by re-reading its keys once per 16 rows, and by masking every block."""
    big = head_dim > 128 or jnp.dtype(dtype) == jnp.float32
    return KernelConfig(block_q=max(1, 16 // padded_group), block_k=32 if big else 64, num_warps=4,
                        num_stages=2 if big else 3, one_loop=True)


def decode_config(dtype, head_dim: int, padded_group: int, *, queries_per_seq: int, num_tokens: int,
                  num_kv_heads: int, max_context: int, num_sms: int) -> KernelConfig:
    """Tiling for decode: 16+ rows (the smallest dot), 64 keys, splits to reach ~16 programs/SM.

    Splits cover >= 512 keys, except in a batch too small to give every SM a program: that is
    latency-bound, and at a few hundred keys 2-4 splits of >= 128 keys plus the combine beat one
    long loop (`benchmarks/attention.py --w1-sweep`). Past 4, the static split count still keeps to
    one per 512 keys of `max_context`, which bounds the combine."""
    big = head_dim > 128 or jnp.dtype(dtype) == jnp.float32
    block_q = max(next_pow2(queries_per_seq), 16 // padded_group, 1)
    block_k = 32 if big else 64
    num_seqs_max = cdiv(num_tokens, queries_per_seq)
    wanted = next_pow2(cdiv(16 * num_sms, num_seqs_max * num_kv_heads))
    split_keys = SHORT_SPLIT_KEYS if num_seqs_max * num_kv_heads < num_sms else MIN_SPLIT_KEYS
    num_splits = max(1, min(wanted, max_context // split_keys, max(4, max_context // MIN_SPLIT_KEYS)))
    return KernelConfig(block_q=block_q, block_k=block_k, num_splits=num_splits,
                        min_split_blocks=max(1, split_keys // block_k),
                        num_warps=4, num_stages=2 if big else 3)


def _spec(q, k_cache, v_cache, sm_scale, sliding_window, soft_cap) -> AttentionSpec:
    num_q_heads, head_dim = q.shape[1:]
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or num_q_heads % num_kv_heads or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {q.shape} does not fit the caches {k_cache.shape}, {v_cache.shape}")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (q.dtype, FP8):
        # Casting here would copy the whole cache on every call; the kernel casts fp8 pages as it reads them.
        raise ValueError(f"the caches must share q's dtype or be {FP8.name}: q {q.dtype}, caches {k_cache.dtype}, "
                         f"{v_cache.dtype}")
    if head_dim != next_pow2(head_dim) or block_size != next_pow2(block_size):
        raise ValueError(f"head_dim {head_dim} and block_size {block_size} must be powers of two")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    group = num_q_heads // num_kv_heads
    return AttentionSpec(sm_scale=float(sm_scale), group=group, padded_group=next_pow2(group),
                         sliding_window=sliding_window,
                         soft_cap=None if soft_cap is None else float(soft_cap))


def _attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, num_seqs, *, spec, cfg,
               interpret, queries=ALL_QUERIES, into=None):
    work = work_list(query_start_loc, seq_lens, num_seqs, num_tokens=q.shape[0], block_q=cfg.block_q, queries=queries)
    out = paged_attention_call(work, q, k_cache, v_cache, block_tables.astype(jnp.int32), spec=spec,
                               cfg=cfg, interpret=interpret, into=into)
    if cfg.num_splits == 1:
        return out
    return combine_splits(*out).astype(q.dtype)


def work_list(query_start_loc, seq_lens, num_seqs, *, num_tokens: int, block_q: int,
              queries: tuple[int, int] = ALL_QUERIES, align: int = 1) -> jax.Array:
    """Cut every sequence's queries into blocks of <= block_q tokens: [num_work, 4] int32 rows of
    (sequence, first token, end token, position of the first token). Only sequences with
    `queries` = [lo, hi) query tokens get blocks (another kernel takes the others). With `align`,
    the blocks are the sequence's share of windows of block_q tokens that start at multiples of
    `align` in the batch (its first block is short by its start's remainder), so that a kernel can
    copy a block's window with TMA into tiled shared memory.

    The padding tail [total, T) is one more pseudo-sequence with no keys, so its tokens get zeros.
    The list has a static length bounding the real count: ceil((T + (align - 1)(S + 1))/block_q) +
    S + 1 (each sequence adds at most one partial block, and its start's remainder) and T (each
    block holds a token); unused rows are empty. It depends only on the batch layout, so XLA
    computes it once for all the layers of a step (CSE).
    """
    num_slots = seq_lens.shape[0]
    qsl = query_start_loc.astype(jnp.int32)
    live = jnp.arange(num_slots) < num_seqs
    total = qsl[num_seqs]
    starts = jnp.append(jnp.where(live, qsl[:-1], total), total)
    lens = jnp.append(jnp.where(live, qsl[1:] - qsl[:-1], 0), num_tokens - total)
    kv_lens = jnp.append(jnp.where(live, seq_lens.astype(jnp.int32), 0), 0)
    if queries != ALL_QUERIES:
        lens = jnp.where((lens >= queries[0]) & (lens < queries[1]), lens, 0)
    lead = starts % align  # tokens of the first window before the sequence's start
    blocks = jnp.where(lens > 0, cdiv(lead + lens, block_q), 0)
    ends = jnp.cumsum(blocks)
    num_work = min(num_tokens, cdiv(num_tokens + (align - 1) * (num_slots + 1), block_q) + num_slots + 1)
    w = jnp.arange(num_work, dtype=jnp.int32)
    # compare_all: one fused comparison instead of a loop of tiny kernels on the GPU.
    seq = jnp.searchsorted(ends, w, side="right", method="compare_all")
    seq = jnp.minimum(seq, num_slots).astype(jnp.int32)
    used = w < ends[-1]
    i = w - (ends[seq] - blocks[seq])
    window = starts[seq] - lead[seq] + i * block_q
    q_start = jnp.maximum(window, starts[seq])
    q_end = jnp.minimum(window + block_q, starts[seq] + lens[seq])
    pos0 = kv_lens[seq] - lens[seq] + q_start - starts[seq]
    table_row = jnp.where(seq < num_slots, seq, 0)
    return jnp.stack([
        jnp.where(used, table_row, 0),
        jnp.where(used, q_start, 0),
        jnp.where(used, q_end, 0),
        jnp.where(used, pos0, 0),
    ], axis=1).astype(jnp.int32)


REFERENCE_CHUNK_KEYS = 128  # keys per round of the reference's loop


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "batch_invariant"))
def reference_ragged_paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    query_start_loc: jax.Array,
    seq_lens: jax.Array,
    block_tables: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    batch_invariant: bool = False,
) -> jax.Array:
    """Pure-jnp ragged paged attention in fp32: each token's keys gathered a chunk of pages at a time,
    with an online softmax, for as many chunks as the longest context needs (a loop bound read at run
    time), so a step costs what its contexts hold, not what max_model_len allows. With a sliding
    window the loop starts at the first chunk any query sees: the pages before it may have been
    given back to the pool (`block_manager`) and hold another request's keys. `batch_invariant`:
    the softmax's sums in a fixed order (`common.tree_sum`): XLA:CPU's order follows the tokens'
    count."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_slots, max_blocks = block_tables.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    group = num_q_heads // num_kv_heads
    pages_per_chunk = min(max(1, REFERENCE_CHUNK_KEYS // block_size), max_blocks)
    chunk = pages_per_chunk * block_size
    num_chunks = -(-max_blocks // pages_per_chunk)
    table = jnp.pad(block_tables, ((0, 0), (0, num_chunks * pages_per_chunk - max_blocks)))

    qsl = query_start_loc
    t = jnp.arange(num_tokens)
    seq = jnp.minimum(jnp.searchsorted(qsl[1:], t, side="right"), num_slots - 1)
    token_ok = t < qsl[num_seqs]
    context = seq_lens[seq]
    pos = context - (qsl[seq + 1] - qsl[seq]) + (t - qsl[seq])
    longest = jnp.max(jnp.where(jnp.arange(num_slots) < num_seqs, seq_lens, 0))
    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
    hi = jax.lax.Precision.HIGHEST

    def add_chunk(c, carry):
        m, den, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(table, c * pages_per_chunk, pages_per_chunk, axis=1)[seq]
        keys = c * chunk + jnp.arange(chunk)
        in_context = keys[None, :] < context[:, None]
        if sliding_window is not None:
            in_context &= keys[None, :] > pos[:, None] - sliding_window

        def gather(cache):  # outside each context zeros, so unwritten (even NaN) cache rows cannot leak in
            rows = cache[pages].reshape(num_tokens, chunk, num_kv_heads, head_dim).astype(jnp.float32)
            return jnp.where(in_context[:, :, None, None], rows, 0.0)

        k, v = gather(k_cache), gather(v_cache)
        visible = in_context & (keys[None, :] <= pos[:, None]) & token_ok[:, None]
        s = jnp.einsum("tkgd,tlkd->tkgl", qg, k, precision=hi) * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=-1))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - shift[..., None])
        scale = jnp.exp(m - shift)
        den = den * scale + (tree_sum(p) if batch_invariant else p.sum(axis=-1))
        acc = acc * scale[..., None] + jnp.einsum("tkgl,tlkd->tkgd", p, v, precision=hi)
        return m_new, den, acc

    heads = (num_tokens, num_kv_heads, group)
    init = (jnp.full(heads, -jnp.inf), jnp.zeros(heads), jnp.zeros((*heads, head_dim)))
    first = 0
    if sliding_window is not None:
        lowest = jnp.min(jnp.where(token_ok, pos, jnp.iinfo(jnp.int32).max))
        first = jnp.maximum(lowest - sliding_window + 1, 0) // chunk
    _, den, acc = jax.lax.fori_loop(first, (longest + chunk - 1) // chunk, add_chunk, init)
    out = acc / jnp.where(den == 0.0, 1.0, den)[..., None]
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
