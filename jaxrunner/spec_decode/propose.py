"""The next drafts of every request that just sampled, proposed on the device and written into its
token row just past its device length: by n-gram lookup in the request's own tokens, or by k
one-token steps of a draft model over the target's pages.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrunner.config import Kernels, ModelConfig, SpeculativeConfig
from jaxrunner.models.llama import Params
from jaxrunner.runner.state import RunnerState
from jaxrunner.runner.step import SampleInputs, TokenInputs, backbone, full_logits
from jaxrunner.sampling import SamplerFlags, SamplingMetadata, process_logits
from jaxrunner.spec_decode.ngram import ngram_drafts
from jaxrunner.spec_decode.rejection import draft_sample


def propose(
    params: Params, draft_params: Params, state: RunnerState, inp: SampleInputs, md: SamplingMetadata,
    flags: SamplerFlags, committing: jax.Array, *, model: ModelConfig, draft_model: ModelConfig | None,
    kernels: Kernels, spec: SpeculativeConfig, kv_scales: tuple[float, float],
) -> RunnerState:
    """Write the next k drafts of every request that just sampled just past its device length."""
    b, k = inp.commit_rows.shape[0], spec.num_speculative_tokens
    slots = jnp.minimum(inp.history_rows, state.token_ids.shape[0] - 1)
    lens = state.lens[slots]
    if draft_model is None:
        drafts = ngram_drafts(state.token_ids[slots], lens, k, spec.prompt_lookup_min, spec.prompt_lookup_max)
        return _write_drafts(state, inp.commit_rows, committing, lens, drafts)

    # A draft model: k one-token steps; step j reads the token at lens - 1 + j (the last kept token,
    # then each draft) and samples the draft at lens + j with the row's parameters (noise included),
    # without grammar masks (the host knows the grammar's state before the drafts only).
    row_md = jax.tree.map(lambda x: x[:: 1 + k], md)
    flags = dataclasses.replace(flags, grammar=False)
    num_rows = state.token_ids.shape[0]
    token_rows = jnp.where(committing, inp.commit_rows, num_rows)

    def step(state: RunnerState, j: jax.Array) -> tuple[RunnerState, None]:
        pos = jnp.maximum(lens - 1 + j, 0)
        tokens = TokenInputs(
            token_ids=jnp.full(b, -1, jnp.int32), token_rows=token_rows, positions=pos,
            query_start_loc=jnp.minimum(jnp.arange(num_rows + 1), b).astype(jnp.int32),
            seq_lens=jnp.zeros(num_rows, jnp.int32).at[:b].set(pos + 1), seq_rows=_pad_rows(slots, num_rows),
            num_seqs=jnp.int32(b), relative=jnp.zeros(b, bool), seq_relative=jnp.zeros(num_rows, bool),
            num_drafts=jnp.zeros(num_rows, jnp.int32), lora_slots=jnp.zeros(0, jnp.int32),
        )
        ids = state.token_ids[slots, pos]
        hidden, draft_kv = backbone(draft_params, draft_model, state.draft_kv, state, tokens, ids, kernels,
                                    kernels.pallas, 1, kv_scales)
        logits = full_logits(draft_params, draft_model, hidden).astype(jnp.float32)
        step_md = dataclasses.replace(row_md, positions=pos + 1)
        history = state.token_ids[slots] if flags.penalties or flags.bad_words else jnp.zeros((b, 0), jnp.int32)
        draft, q = draft_sample(process_logits(logits, step_md, flags, history, kernels), step_md)
        col = jnp.where(committing, pos + 1, state.token_ids.shape[1])
        probs = state.draft_probs.at[token_rows, j].set(q, mode="drop") if state.draft_probs.size else state.draft_probs
        token_ids = state.token_ids.at[token_rows, col].set(draft, mode="drop")
        return dataclasses.replace(state, token_ids=token_ids, draft_kv=draft_kv, draft_probs=probs), None

    state, _ = jax.lax.scan(step, state, jnp.arange(k))
    return state


def _pad_rows(slots: jax.Array, num_rows: int) -> jax.Array:
    return jnp.zeros(num_rows, jnp.int32).at[: slots.shape[0]].set(slots)


def _write_drafts(state: RunnerState, rows: jax.Array, committing: jax.Array, lens: jax.Array, drafts: jax.Array) -> RunnerState:
    k = drafts.shape[1]
    cols = jnp.where(committing[:, None], lens[:, None] + jnp.arange(k)[None, :], state.token_ids.shape[1])
    return dataclasses.replace(state, token_ids=state.token_ids.at[rows[:, None], cols].set(drafts, mode="drop"))
