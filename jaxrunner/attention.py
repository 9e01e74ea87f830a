"""Paged attention for the model: write this step's K/V into the cache, then attend over it.

The metadata describes one ragged batch: sequence s owns queries
`query_start_loc[s]:query_start_loc[s+1]`, the last tokens of its `seq_lens[s]` tokens, whose keys
live in the pages `block_tables[s]`. Prefill chunks and decodes mix freely in one call.
"""

from __future__ import annotations

import functools

import jax

from jaxrunner.config import ModelConfig
from jaxrunner.pytree import pytree_dataclass
from pallas_kernels import (
    ragged_paged_attention,
    ragged_paged_attention_decode,
    reference_ragged_paged_attention,
    write_kv,
)


@pytree_dataclass
class AttentionMetadata:
    slot_mapping: jax.Array  # i32 [T]: block * block_size + offset of each token's K/V; -1 for padding
    query_start_loc: jax.Array  # i32 [S + 1]
    seq_lens: jax.Array  # i32 [S]
    block_tables: jax.Array  # i32 [S, max_blocks]
    num_seqs: jax.Array  # i32 []


def paged_attend(model: ModelConfig, md: AttentionMetadata, *, uniform_decode: bool = False):
    """The model's per-layer attention for one batch: write the new K/V into the pages, then attend.

    On a GPU both halves are Pallas kernels (the KV write aliased in place; the decode-specialised
    attention when every sequence has one query token). Elsewhere (CPU tests) they are the
    pure-jnp scatter and reference, which compute the same function.
    """
    options = dict(sm_scale=model.head_dim**-0.5, sliding_window=model.sliding_window, uniform_decode=uniform_decode)

    def attend(layer: int, q: jax.Array, k: jax.Array, v: jax.Array, kv: tuple) -> tuple[jax.Array, tuple]:
        return _attend_layer(q, k, v, kv, md, **options)

    return attend


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "uniform_decode"))
def _attend_layer(q: jax.Array, k: jax.Array, v: jax.Array, kv: tuple, md: AttentionMetadata, *,
                  sm_scale: float, sliding_window: int | None, uniform_decode: bool) -> tuple[jax.Array, tuple]:
    """One layer's KV write and attention. A jitted function, so a step's program traces and lowers
    it (the Pallas kernels into Triton: the bulk of start-up) once for all its layers, not once per
    layer; XLA inlines the calls, so the compiled step is the same."""
    on_gpu = jax.default_backend() == "gpu"
    if on_gpu:
        attention = ragged_paged_attention_decode if uniform_decode else ragged_paged_attention
    else:
        attention = reference_ragged_paged_attention
    k_cache, v_cache = write_kv(*kv, k, v, md.slot_mapping, impl="pallas" if on_gpu else "xla")
    out = attention(q, k_cache, v_cache, md.query_start_loc, md.seq_lens, md.block_tables, md.num_seqs,
                    sm_scale=sm_scale, sliding_window=sliding_window)
    return out, (k_cache, v_cache)
