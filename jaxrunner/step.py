"""The jitted device side of a step: three pure functions over the donated RunnerState.

- `write_block_rows`: copy changed block-table rows in (only on steps where some request got blocks).
- `forward_step` (one graph per token bucket, and one more per bucket that holds only decodes, for
  the decode-specialised attention): gather input ids, write KV, run the model, keep the hidden
  state of each sequence's last token ([S] rows, S = max_num_seqs).
- `sample_step` (one graph per request bucket and sampler variant): logits for the batch's rows,
  sample, append the tokens that complete a request's known tokens to its row.
- `prompt_logprobs_step` (one graph, fixed chunk): logprobs of prompt tokens from the backbone's
  hidden states, for requests that ask for prompt logprobs.
Splitting at the last-token hidden states keeps the number of graphs at T + R, not T x R.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrunner.attention import AttentionMetadata, paged_attend
from jaxrunner.config import ModelConfig
from jaxrunner.input_batch import SampleInputs, TokenInputs
from jaxrunner.models.llama import Params, compute_logits, forward
from jaxrunner.sampling import SamplerFlags, SamplerOutput, compute_logprobs, sample
from jaxrunner.state import RunnerState


def matmul_precision(params: Params) -> str:
    """fp32 models get true fp32 matmuls (GPUs would otherwise use TF32 and break fp32 parity)."""
    return "highest" if params["embed"].dtype == jnp.float32 else "default"


def write_block_rows(state: RunnerState, slots: jax.Array, rows: jax.Array) -> RunnerState:
    table = state.block_table.at[slots].set(rows, mode="drop")
    return dataclasses.replace(state, block_table=table)


def forward_step(
    params: Params, state: RunnerState, inp: TokenInputs, *, model: ModelConfig, uniform_decode: bool
) -> tuple[jax.Array, jax.Array, RunnerState]:
    """(hidden state of each sequence's last token [S, H], of every token [T, H], the new state)."""
    num_rows = state.token_ids.shape[0]
    block_size = state.kv[0][0].shape[1]
    rows = jnp.minimum(inp.token_rows, num_rows - 1)
    ids = jnp.where(inp.token_ids >= 0, inp.token_ids, state.token_ids[rows, inp.positions])
    token_ids = state.token_ids.at[inp.token_rows, inp.positions].set(ids, mode="drop")
    block = state.block_table[rows, inp.positions // block_size]
    slot_mapping = jnp.where(inp.token_rows < num_rows, block * block_size + inp.positions % block_size, -1)
    md = AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=inp.query_start_loc,
        seq_lens=inp.seq_lens,
        block_tables=state.block_table[inp.seq_rows],
        num_seqs=inp.num_seqs,
    )
    with jax.default_matmul_precision(matmul_precision(params)):
        hidden, kv = forward(params, model, ids, inp.positions, state.kv, paged_attend(model, md, uniform_decode=uniform_decode))
    last = hidden[jnp.maximum(inp.query_start_loc[1:] - 1, 0)]
    return last, hidden, dataclasses.replace(state, token_ids=token_ids, kv=kv)


def sample_step(
    params: Params, state: RunnerState, last_hidden: jax.Array, inp: SampleInputs, *, model: ModelConfig, flags: SamplerFlags
) -> tuple[SamplerOutput, RunnerState]:
    with jax.default_matmul_precision(matmul_precision(params)):
        logits = compute_logits(params, model, last_hidden[: inp.commit_rows.shape[0]])
    if flags.penalties or flags.bad_words:
        history = state.token_ids[inp.history_rows]
    else:
        history = jnp.zeros((logits.shape[0], 0), jnp.int32)
    out = sample(logits, inp.sampling, flags, history)
    token_ids = state.token_ids.at[inp.commit_rows, inp.sampling.positions].set(out.tokens, mode="drop")
    return out, dataclasses.replace(state, token_ids=token_ids)


def prompt_logprobs_step(
    params: Params, hidden: jax.Array, rows: jax.Array, targets: jax.Array, *, model: ModelConfig, num_top: int, as_logits: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Logprobs of `targets` (and the top `num_top`) from the logits at hidden[rows]; raw logits, as vLLM."""
    with jax.default_matmul_precision(matmul_precision(params)):
        logits = compute_logits(params, model, hidden[rows])
    return compute_logprobs(logits, targets, num_top, as_logits)
