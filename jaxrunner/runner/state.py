"""The device-resident request state: one pytree, donated to every step, whose structure never changes.

What lives here is what the device produces or consumes in bulk: every request row's tokens (the
sampled ones exist only here until the host reads them), its block table, and the paged KV cache.
What the scheduler decides (lengths, sampling parameters) is mirrored on the host
(`input_batch.RequestTable`) and travels with each step's inputs.

With speculative decoding the device also knows what the host cannot until a step's output is
back: how many tokens each row really has (`lens`; a step keeps 1 to k + 1 of them), and the next
drafts, which sit in `token_ids` just past `lens`. A draft model adds its own KV cache (same
pages, same block table) and the draft distributions q of those drafts. The arrays of a feature that
is off are zero-width, so the structure depends only on the configuration.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax.sharding import PartitionSpec as P

from jaxrunner.config import ModelConfig, RunnerConfig
from jaxrunner.models.llama import MODEL_AXIS
from jaxrunner.pytree import pytree_dataclass


@pytree_dataclass
class RunnerState:
    token_ids: jax.Array  # i32 [max_num_seqs, max_model_len]: prefill tokens, sampled tokens, then drafts
    block_table: jax.Array  # i32 [kv-cache groups, max_num_seqs, max_blocks_per_req]
    # per member of a KV-cache group (`ModelConfig.kv_cache_groups`; per layer when there is one group)
    # (k, v), each [num_blocks, block_size, num_kv_heads, head_dim]
    kv: tuple
    lens: jax.Array  # i32 [max_num_seqs] (speculative decoding; else [0]): tokens known per row
    draft_kv: tuple  # the draft model's `kv` (else ())
    draft_probs: jax.Array  # f32 [max_num_seqs, k, V]: the drafts' q (draft model, not batch-invariant; else [0, 0, 0])


def state_specs(state: RunnerState) -> RunnerState:
    """Each field's PartitionSpec under tensor parallelism: the KV pages split by head, the rest
    replicated."""
    pages = P(None, None, MODEL_AXIS, None)
    return RunnerState(P(), P(), tuple((pages, pages) for _ in state.kv), P(),
                       tuple((pages, pages) for _ in state.draft_kv), P())


def init_state(model: ModelConfig, cfg: RunnerConfig, draft: ModelConfig | None = None) -> RunnerState:
    def pages(m: ModelConfig) -> tuple:
        page = (cfg.num_blocks, cfg.block_size, m.num_kv_heads, m.head_dim)
        return tuple((jnp.zeros(page, cfg.kv_dtype), jnp.zeros(page, cfg.kv_dtype)) for _ in range(m.group_size))

    spec = cfg.speculative.num_speculative_tokens
    rows = cfg.max_num_seqs
    return RunnerState(
        token_ids=jnp.zeros((rows, cfg.max_model_len), jnp.int32),
        block_table=jnp.zeros((len(model.kv_cache_groups), rows, cfg.max_blocks_per_req), jnp.int32),
        kv=pages(model),
        lens=jnp.zeros(rows if spec else 0, jnp.int32),
        draft_kv=pages(draft) if draft is not None else (),
        # Batch-invariant, a draft model's drafts are verified as point masses: their q is not kept.
        draft_probs=jnp.zeros((rows, spec, model.vocab_size) if draft is not None and not cfg.batch_invariant
                              else (0, 0, 0), jnp.float32),
    )
