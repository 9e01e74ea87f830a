"""The device-resident request state: one pytree, donated to every step, whose structure never changes.

What lives here is what the device produces or consumes in bulk: every request row's tokens (the
sampled ones exist only here until the host reads them), its block table, and the paged KV cache.
What the scheduler decides (lengths, sampling parameters) is mirrored on the host
(`input_batch.RequestTable`) and travels with each step's inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrunner.config import ModelConfig, RunnerConfig
from jaxrunner.pytree import pytree_dataclass


@pytree_dataclass
class RunnerState:
    token_ids: jax.Array  # i32 [max_num_seqs, max_model_len]: prefill tokens, then sampled tokens
    block_table: jax.Array  # i32 [max_num_seqs, max_blocks_per_req]
    kv: tuple  # per layer (k, v), each [num_blocks, block_size, num_kv_heads, head_dim]


def kv_cache_bytes(model: ModelConfig, cfg: RunnerConfig) -> int:
    per_layer = 2 * cfg.num_blocks * cfg.block_size * model.num_kv_heads * model.head_dim
    return per_layer * model.num_layers * cfg.jnp_dtype.itemsize


def init_state(model: ModelConfig, cfg: RunnerConfig) -> RunnerState:
    page = (cfg.num_blocks, cfg.block_size, model.num_kv_heads, model.head_dim)
    return RunnerState(
        token_ids=jnp.zeros((cfg.max_num_seqs, cfg.max_model_len), jnp.int32),
        block_table=jnp.zeros((cfg.max_num_seqs, cfg.max_blocks_per_req), jnp.int32),
        kv=tuple((jnp.zeros(page, cfg.jnp_dtype), jnp.zeros(page, cfg.jnp_dtype)) for _ in range(model.num_layers)),
    )
