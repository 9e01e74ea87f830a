"""Paged attention for the model: write this step's K/V into the cache, then attend over it.

The metadata describes one ragged batch: sequence s owns queries
`query_start_loc[s]:query_start_loc[s+1]`, the last tokens of its `seq_lens[s]` tokens, whose keys
live in the pages `block_tables[s]`. Prefill chunks and decodes mix freely in one call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrunner.config import ModelConfig
from jaxrunner.pytree import pytree_dataclass


@pytree_dataclass
class AttentionMetadata:
    slot_mapping: jax.Array  # i32 [T]: block * block_size + offset of each token's K/V; -1 for padding
    query_start_loc: jax.Array  # i32 [S + 1]
    seq_lens: jax.Array  # i32 [S]
    block_tables: jax.Array  # i32 [S, max_blocks]
    num_seqs: jax.Array  # i32 []


def write_kv(
    k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Scatter [T, Hkv, D] keys/values into [num_blocks, block_size, Hkv, D] pages; -1 slots are dropped.

    A scatter into a donated buffer is done in place by XLA (the step's memory analysis test checks it).
    """
    num_blocks, block_size = k_cache.shape[:2]
    block = jnp.where(slot_mapping < 0, num_blocks, slot_mapping // block_size)
    offset = slot_mapping % block_size
    k_cache = k_cache.at[block, offset].set(k.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[block, offset].set(v.astype(v_cache.dtype), mode="drop")
    return k_cache, v_cache


def reference_paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    md: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Pure-jnp ragged paged attention: each token gathers its sequence's whole context.

    Memory grows as T x max_model_len, so this is the readable reference and the CPU path, not the
    serving path on GPU.
    """
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    qsl = md.query_start_loc
    tokens = jnp.arange(t)
    seq = jnp.clip(jnp.searchsorted(qsl, tokens, side="right") - 1, 0, md.seq_lens.shape[0] - 1)
    valid = tokens < qsl[md.num_seqs]
    pos = md.seq_lens[seq] - (qsl[seq + 1] - qsl[seq]) + (tokens - qsl[seq])

    pages = md.block_tables[seq]  # [T, max_blocks]
    keys = k_cache[pages].reshape(t, -1, hkv, d)  # [T, L, Hkv, D]
    values = v_cache[pages].reshape(t, -1, hkv, d)
    qg = q.reshape(t, hkv, hq // hkv, d)
    scores = jnp.einsum("tkgd,tlkd->tkgl", qg, keys, preferred_element_type=jnp.float32) * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    kpos = jnp.arange(keys.shape[1])[None, :]
    mask = kpos <= pos[:, None]
    if sliding_window is not None:
        mask &= kpos > pos[:, None] - sliding_window
    mask &= valid[:, None]
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(jnp.where(valid[:, None, None, None], scores, 0.0), axis=-1)
    out = jnp.einsum("tkgl,tlkd->tkgd", probs.astype(values.dtype), values, preferred_element_type=jnp.float32)
    return jnp.where(valid[:, None, None], out.reshape(t, hq, d), 0.0).astype(q.dtype)


def paged_attend(model: ModelConfig, md: AttentionMetadata):
    """The model's per-layer attention for one batch: write the new K/V into the pages, then attend."""
    scale = model.head_dim**-0.5

    def attend(layer: int, q: jax.Array, k: jax.Array, v: jax.Array, kv: tuple) -> tuple[jax.Array, tuple]:
        k_cache, v_cache = write_kv(*kv, k, v, md.slot_mapping)
        out = reference_paged_attention(q, k_cache, v_cache, md, sm_scale=scale, sliding_window=model.sliding_window)
        return out, (k_cache, v_cache)

    return attend
