"""A speculative decoding step's sampling, on the device: verify each request's drafts, keep 1 to
1 + k tokens, and propose the next drafts (`propose.py`). It runs in place of the plain sampler
(`runner.step.sample_step`) whenever speculative decoding is on.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrunner.config import Kernels, ModelConfig, SpeculativeConfig
from jaxrunner.models.llama import Params
from jaxrunner.models.row_tiles import per_row
from jaxrunner.runner.state import RunnerState
from jaxrunner.runner.step import SampleInputs, full_logits, logits_matmul
from jaxrunner.sampling import NO_LOGPROBS, SamplerFlags, SamplerOutput, compute_logprobs, process_logits
from jaxrunner.spec_decode.propose import propose
from jaxrunner.spec_decode.rejection import verify_drafts


def spec_sample_step(
    params: Params, draft_params: Params, state: RunnerState, last_hidden: jax.Array, samples: SampleInputs, *,
    model: ModelConfig, draft_model: ModelConfig | None, kernels: Kernels, flags: SamplerFlags,
    spec: SpeculativeConfig, kv_scales: tuple[float, float],
) -> tuple[SamplerOutput, jax.Array, RunnerState]:
    """Verify each request's drafts, keep 1 to 1 + num_drafts tokens, and propose the next drafts.

    Request b's row 0 samples the token at position `base` (its device length for a decode), row i
    the token at base + i, after drafts 1..i (which sit at base..base + i - 1 in its token row).
    Every row is processed like a plain sample (its own position for penalties, min_tokens and the
    noise), then `verify_drafts` decides. The kept tokens are appended and the row's device length
    set; rows that sampled then get their next k drafts written just past it. Returns (outputs
    [1 + k, B] like a multi-step call's, the number of tokens kept per request [B], the next drafts
    [B, k], the state). A grammar mask per position (sampling.grammar_bitmask [B, (1 + k) W])
    constrains each row.
    """
    b, k = samples.commit_rows.shape[0], spec.num_speculative_tokens
    k1, num_rows = 1 + k, state.token_ids.shape[0]
    tiled = kernels.batch_invariant
    logits = full_logits(params, model, last_hidden[:b].reshape(b * k1, -1), logits_matmul(kernels)).astype(jnp.float32)
    slots = jnp.minimum(samples.history_rows, num_rows - 1)
    base = jnp.where(samples.relative, state.lens[slots] + samples.sampling.positions, samples.sampling.positions)
    positions = base[:, None] + jnp.arange(k1)[None, :]  # [B, 1 + k]
    md = jax.tree.map(lambda x: jnp.repeat(x, k1, axis=0), samples.sampling)
    masks = samples.sampling.grammar_bitmask
    md = dataclasses.replace(md, positions=positions.reshape(-1),
                             grammar_bitmask=masks.reshape(b * k1, masks.shape[1] // k1))
    history = (state.token_ids[jnp.repeat(samples.history_rows, k1)] if flags.penalties or flags.bad_words
               else jnp.zeros((b * k1, 0), jnp.int32))
    processed = per_row(lambda r: process_logits(r[0], r[1], flags, r[2], kernels), (logits, md, history), tiled)
    drafts = jnp.take_along_axis(state.token_ids[slots], jnp.clip(positions[:, :k], 0, state.token_ids.shape[1] - 1), axis=1)
    num_drafts = jnp.minimum(samples.num_drafts, k)
    # Batch-invariant, a draft model's q is not kept (`state.init_state`): its drafts are verified as
    # point masses, so the tokens are plain sampling's whatever was drafted (`rejection`).
    draft_probs = state.draft_probs[slots] if state.draft_probs.size else None
    tokens, num_kept = verify_drafts(processed, md, drafts, num_drafts, draft_probs)

    kept = jnp.arange(k1)[None, :] < num_kept[:, None]
    committing = samples.commit_rows < num_rows
    cols = jnp.where(kept & committing[:, None], positions, state.token_ids.shape[1])  # out of range: dropped
    token_ids = state.token_ids.at[samples.commit_rows[:, None], cols].set(tokens, mode="drop")
    lens = state.lens.at[samples.commit_rows].set(base + num_kept, mode="drop")
    state = dataclasses.replace(state, token_ids=token_ids, lens=lens)
    state = propose(params, draft_params, state, samples, md, flags, committing, model=model, draft_model=draft_model,
                    kernels=kernels, spec=spec, kv_scales=kv_scales)
    next_lens = state.lens[slots]
    next_drafts = jnp.take_along_axis(
        state.token_ids[slots], jnp.clip(next_lens[:, None] + jnp.arange(k)[None, :], 0, state.token_ids.shape[1] - 1), axis=1)

    num_nans = jnp.sum(jnp.isnan(logits), axis=1, dtype=jnp.int32).reshape(b, k1) * kept if flags.count_nans else (
        jnp.zeros((b, k1), jnp.int32))
    flat = tokens.reshape(-1)
    if flags.num_logprobs == NO_LOGPROBS:
        empty = jnp.zeros((b * k1, 0), jnp.float32)
        values, ids, ranks = empty, empty.astype(jnp.int32), jnp.zeros(b * k1, jnp.int32)
    else:
        source = processed if flags.logprobs_mode.startswith("processed") else logits
        values, ids, ranks = per_row(lambda r: compute_logprobs(
            r[0], r[1], flags.num_logprobs, flags.logprobs_mode.endswith("logits")), (source, flat), tiled)

    def steps_first(x: jax.Array) -> jax.Array:  # [B * (1 + k), ...] -> [1 + k, B, ...]
        return jnp.swapaxes(x.reshape(b, k1, *x.shape[1:]), 0, 1)

    out = SamplerOutput(steps_first(flat), steps_first(values), steps_first(ids), steps_first(ranks),
                        steps_first(num_nans.reshape(-1)))
    return out, num_kept, next_drafts, state
