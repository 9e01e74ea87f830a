"""Random ragged paged-attention batches for the kernel tests (CPU interpret mode and GPU).

Every batch is built from a seed: fresh random lengths, a shuffled pool of non-contiguous pages,
contexts that end mid-page, block-table entries past a context pointing outside the cache, and a
cache poisoned with NaN everywhere except the rows a context holds. A kernel that reads anything it
should not, or leaves an output element unwritten, produces NaN and fails.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

KINDS = ("decode", "chunk", "prefill", "single", "spec")


@dataclasses.dataclass
class Batch:
    q: jnp.ndarray
    k_cache: jnp.ndarray
    v_cache: jnp.ndarray
    query_start_loc: jnp.ndarray
    seq_lens: jnp.ndarray
    block_tables: jnp.ndarray
    num_seqs: jnp.ndarray
    total: int

    @property
    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.query_start_loc, self.seq_lens,
                self.block_tables, self.num_seqs)


def plan_lengths(rng, *, num_slots: int, num_tokens: int, max_context: int, kinds=KINDS,
                 max_chunk: int = 20, fill: bool = False) -> tuple[list[int], list[int]]:
    """Query and context lengths for a random number of live sequences.

    The first sequences take each kind once (decode: 1 query after a cached context; chunk: a
    prefill chunk after cached tokens; prefill: a whole prompt; single: a one-token prompt; spec:
    1 + drafts), the rest are random kinds; chunks and prompts have 2..max_chunk tokens. `fill`
    stretches the last sequence to leave no padding tail (as far as max_context allows).
    """
    num_live = int(rng.integers(min(len(kinds), num_slots), num_slots + 1))
    q_lens, ctx_lens = [], []
    budget = num_tokens
    for i in range(num_live):
        kind = kinds[i] if i < len(kinds) else kinds[int(rng.integers(len(kinds)))]
        q = {"decode": 1, "single": 1, "spec": int(rng.integers(2, 5)),
             "chunk": int(rng.integers(2, max_chunk)), "prefill": int(rng.integers(2, max_chunk))}[kind]
        q = min(q, budget - (num_live - 1 - i), max_context)
        if q < 1:
            break
        budget -= q
        if kind == "single":
            ctx = 1
        elif kind == "prefill":
            ctx = q
        else:
            ctx = int(rng.integers(min(q + 1, max_context), max_context + 1))
        q_lens.append(q)
        ctx_lens.append(max(ctx, q))
    if fill:
        grow = min(budget, max_context - ctx_lens[-1])
        q_lens[-1] += grow
        ctx_lens[-1] += grow
    return q_lens, ctx_lens


def make_batch(seed: int, *, dtype, head_dim: int, block_size: int, num_kv_heads: int, group: int,
               num_slots: int = 6, num_tokens: int = 64, max_blocks: int = 8, max_chunk: int = 20,
               fill: bool = False,
               q_lens: list[int] | None = None, ctx_lens: list[int] | None = None,
               q_scale: float = 1.0, poison: float = np.nan) -> Batch:
    """A batch from `seed` (or from the given lengths), laid out as the runner would hand it over.

    Cache rows outside every context hold `poison` (NaN by default; a huge finite value for kernels
    that require finite rows, where a stray read still ruins the result)."""
    rng = np.random.default_rng(seed)
    max_context = max_blocks * block_size
    if q_lens is None:
        q_lens, ctx_lens = plan_lengths(rng, num_slots=num_slots, num_tokens=num_tokens,
                                        max_context=max_context, max_chunk=max_chunk, fill=fill)
    num_live = len(q_lens)
    num_blocks = num_slots * max_blocks + 3
    qsl = np.full(num_slots + 1, sum(q_lens), np.int32)
    qsl[: num_live + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    # Padding slots carry garbage lengths and tables: the kernel must ignore them.
    seq_lens = rng.integers(0, max_context + 1, num_slots).astype(np.int32)
    seq_lens[:num_live] = ctx_lens
    tables = rng.integers(num_blocks, 4 * num_blocks, (num_slots, max_blocks)).astype(np.int32)
    pool = iter(rng.permutation(num_blocks))
    num_heads = num_kv_heads * group
    k_cache = np.full((num_blocks, block_size, num_kv_heads, head_dim), poison, np.float32)
    v_cache = np.full_like(k_cache, poison)
    for s in range(num_live):
        for b in range(-(-ctx_lens[s] // block_size)):
            tables[s, b] = next(pool)
        keys = np.arange(ctx_lens[s])
        pages, rows = tables[s, keys // block_size], keys % block_size
        k_cache[pages, rows] = rng.standard_normal((len(keys), num_kv_heads, head_dim))
        v_cache[pages, rows] = rng.standard_normal((len(keys), num_kv_heads, head_dim))
    q = q_scale * rng.standard_normal((num_tokens, num_heads, head_dim)).astype(np.float32)
    q[sum(q_lens):] = np.nan  # padding tokens: whatever they hold must not matter
    return Batch(
        q=jnp.asarray(q, dtype), k_cache=jnp.asarray(k_cache, dtype),
        v_cache=jnp.asarray(v_cache, dtype), query_start_loc=jnp.asarray(qsl),
        seq_lens=jnp.asarray(seq_lens), block_tables=jnp.asarray(tables),
        num_seqs=jnp.int32(num_live), total=sum(q_lens))


def naive_attention(batch: Batch, *, sm_scale: float, sliding_window=None, soft_cap=None) -> np.ndarray:
    """Token-by-token numpy attention in float64: the reference's own reference."""
    q = np.asarray(batch.q, np.float64)
    k_cache = np.asarray(batch.k_cache, np.float64)
    v_cache = np.asarray(batch.v_cache, np.float64)
    qsl = np.asarray(batch.query_start_loc)
    seq_lens = np.asarray(batch.seq_lens)
    tables = np.asarray(batch.block_tables)
    block_size, num_kv_heads = k_cache.shape[1:3]
    group = q.shape[1] // num_kv_heads
    out = np.zeros_like(q)
    for s in range(int(batch.num_seqs)):
        q_len = qsl[s + 1] - qsl[s]
        for i in range(q_len):
            t = qsl[s] + i
            pos = seq_lens[s] - q_len + i
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            keys = np.arange(lo, pos + 1)
            pages = tables[s, keys // block_size]
            k = k_cache[pages, keys % block_size]  # [n, Hkv, D]
            v = v_cache[pages, keys % block_size]
            for h in range(q.shape[1]):
                scores = k[:, h // group] @ q[t, h] * sm_scale
                if soft_cap is not None:
                    scores = soft_cap * np.tanh(scores / soft_cap)
                p = np.exp(scores - scores.max())
                out[t, h] = (p / p.sum()) @ v[:, h // group]
    return out
