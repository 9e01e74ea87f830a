"""The device side of a step: pure functions over the donated RunnerState, and their input pytrees.

- `write_block_rows`: copy changed block-table rows in (only on steps where some request got blocks).
- `write_token_rows`: copy a new request's prefill tokens into its row (only for requests whose
  prefix came from the prefix cache: the backbone writes the tokens it computes, not the cached ones).
- `forward_step` (one graph per token bucket, and one more per bucket that holds only decodes, for
  the decode-specialised attention): gather input ids, write KV, run the model (and the draft
  model, over the same tokens and pages, when there is one), keep the hidden states of each
  sequence's last 1 + k tokens ([S, 1 + k] rows, S = max_num_seqs; k drafts, 0 without
  speculative decoding).
- `sample_step` (one graph per request bucket and sampler variant): logits for the batch's rows,
  sample, append the tokens that complete a request's known tokens to its row.
- `spec_sample_step` (speculative decoding: one graph per request bucket and sampler variant, in
  place of `sample_step`): logits at each request's 1 + k positions, the rejection sampler, the
  kept tokens appended, then the next drafts proposed on the device.
- `decode_loop` (multi-step decode, one graph per request bucket, sampler variant and step count):
  `num_steps` rounds of forward + sample in one device call, each feeding its tokens to the next.
- `prompt_logprobs_step` (one graph, fixed chunk): logprobs of prompt tokens from the backbone's
  hidden states, for requests that ask for prompt logprobs.
- `write_slot` (`models.lora`, one graph): an adapter written into a LoRA slot; the backbone reads
  each token's slot from `TokenInputs.lora_slots`.
Splitting at the last-token hidden states keeps the number of graphs at T + R, not T x R.
`programs.py` compiles each of them per bucket and option; `kernels` (a static `Kernels`) says
whether the Pallas kernels or the jnp references run.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxrunner.models.attention import AttentionMetadata, paged_attend
from jaxrunner.config import Kernels, ModelConfig, SpeculativeConfig
from jaxrunner.models.llama import MODEL_AXIS, Params, compute_logits, forward, slot_mask
from jaxrunner.lora.slots import Lora
from jaxrunner.models.moe import GroupedMatmul
from jaxrunner.spec_decode.ngram import ngram_drafts
from jaxrunner.pytree import pytree_dataclass
from jaxrunner.sampling import (
    NO_LOGPROBS,
    SamplerFlags,
    SamplerOutput,
    SamplingMetadata,
    compute_logprobs,
    draft_sample,
    process_logits,
    sample,
    verify_drafts,
)
from jaxrunner.runner.state import RunnerState
from pallas_kernels.grouped_matmul import grouped_matmul, supported


@pytree_dataclass
class TokenInputs:
    """Per-token ([T]) and per-sequence ([S] = max_num_seqs) inputs of the backbone.

    With speculative decoding the host does not know how many tokens a decoding request has (the
    step in flight keeps 1 to k + 1); its positions and length are then `relative`: counted from the
    row's device length `state.lens` (position = lens - 1 + offset, seq_len = lens - 1 + seq_lens).
    """

    token_ids: jax.Array  # i32 [T]; -1: read the token from the device state (a sampled token, a draft)
    token_rows: jax.Array  # i32 [T]; the request slot; max_num_seqs for padding
    positions: jax.Array  # i32 [T]
    query_start_loc: jax.Array  # i32 [S + 1]
    seq_lens: jax.Array  # i32 [S]
    seq_rows: jax.Array  # i32 [S]
    num_seqs: jax.Array  # i32 []
    relative: jax.Array  # bool [T]: the position is an offset from the row's device length - 1
    seq_relative: jax.Array  # bool [S]
    num_drafts: jax.Array  # i32 [S]: draft tokens among the sequence's last query tokens
    lora_slots: jax.Array  # i32 [T]: the token's LoRA slot value (0: base model); [0] without LoRA


@pytree_dataclass
class SampleInputs:
    """Per-request ([B]) inputs of the logits + sampler step."""

    commit_rows: jax.Array  # i32 [B]; slot to append the sampled token to; max_num_seqs: discard
    history_rows: jax.Array  # i32 [B]; slot whose token row penalties and bad words read
    sampling: SamplingMetadata
    relative: jax.Array  # bool [B]: sampling.positions is an offset from the row's device length
    num_drafts: jax.Array  # i32 [B]


def full_logits(params: Params, model: ModelConfig, hidden: jax.Array) -> jax.Array:
    """fp32 logits [N, vocab_size] of the hidden states, whole on every device. Under tensor
    parallelism each device computes its slice of the vocabulary (the LM head is split by it), then
    the slices are gathered, so the sampler works on full rows and the head's weight never moves;
    the padded vocabulary's extra columns are then cut off, so no token that does not exist is
    sampled, ranked or returned."""
    with jax.default_matmul_precision(matmul_precision(params)):
        logits = compute_logits(params, model, hidden)
    if not jax.sharding.get_abstract_mesh().empty:
        logits = jax.lax.with_sharding_constraint(jax.lax.with_sharding_constraint(logits, P(None, MODEL_AXIS)), P())
    return logits[:, : model.vocab_size]


def matmul_precision(params: Params) -> str:
    """fp32 models get true fp32 matmuls (GPUs would otherwise use TF32 and break fp32 parity)."""
    return "highest" if params["embed"].dtype == jnp.float32 else "default"


def write_block_rows(state: RunnerState, slots: jax.Array, rows: jax.Array) -> RunnerState:
    """`rows` [groups, len(slots), max_blocks]: each slot's row of every KV-cache group's table."""
    table = state.block_table.at[:, slots].set(rows, mode="drop")
    return dataclasses.replace(state, block_table=table)


def write_token_rows(state: RunnerState, slots: jax.Array, rows: jax.Array) -> RunnerState:
    """`rows` [len(slots), max_model_len]: each slot's whole token row. Penalties, bad words and
    n-gram drafts read a row's history from position 0, so a request starting past a cached prefix
    must not see the slot's previous occupant there."""
    return dataclasses.replace(state, token_ids=state.token_ids.at[slots].set(rows, mode="drop"))


def resolve_positions(state: RunnerState, inp: TokenInputs) -> TokenInputs:
    """Relative positions and lengths made absolute from the rows' device lengths."""
    if not state.lens.shape[0]:
        return inp
    rows = jnp.minimum(inp.token_rows, state.lens.shape[0] - 1)
    base, seq_base = state.lens[rows] - 1, state.lens[inp.seq_rows] - 1
    return dataclasses.replace(
        inp,
        positions=jnp.where(inp.relative, base + inp.positions, inp.positions),
        seq_lens=jnp.where(inp.seq_relative, seq_base + inp.seq_lens, inp.seq_lens),
    )


@functools.cache
def moe_matmul(kernels: Kernels, model: ModelConfig) -> GroupedMatmul:
    """The MoE MLP's grouped matmul: the Pallas kernel along with the Pallas attention (XLA's
    `ragged_dot` reads every expert's weights), where its shapes allow; else `ragged_dot`. Cached,
    so each choice is one object: the jitted decoder layer takes it as a static argument."""
    if kernels.pallas and supported(model.hidden_size, 2 * model.intermediate_size) and supported(
            model.intermediate_size, model.hidden_size):
        return functools.partial(grouped_matmul, interpret=kernels.interpret)
    return jax.lax.ragged_dot


def backbone(
    params: Params, model: ModelConfig, kv: tuple, state: RunnerState, inp: TokenInputs, ids: jax.Array,
    kernels: Kernels, uniform_decode: bool, queries_per_seq: int, kv_scales: tuple[float, float], lora: Lora = (),
    max_loras: int = 0,
) -> tuple[jax.Array, tuple]:
    """One model over the batch `inp` (absolute positions) with its paged cache `kv` (an fp8 one's
    `kv_scales`), and its LoRA slots (() for none): (hidden [T, H], kv). Its KV-cache groups are
    the first of the state's block tables (a draft model has one group, the target's only one)."""
    num_rows = state.token_ids.shape[0]
    block_size = kv[0][0].shape[1]
    rows = jnp.minimum(inp.token_rows, num_rows - 1)
    tables = state.block_table[: len(model.kv_cache_groups)]
    blocks = tables[:, rows, inp.positions // block_size]
    inside = (inp.token_rows < num_rows) & (inp.positions < state.token_ids.shape[1])  # proposals may run past the end
    slot_mapping = jnp.where(inside, blocks * block_size + inp.positions % block_size, -1)
    seq_tables = tables[:, inp.seq_rows]
    attend = tuple(
        paged_attend(model, AttentionMetadata(slot_mapping[g], inp.query_start_loc, inp.seq_lens, seq_tables[g],
                                              inp.num_seqs),
                     kernels, uniform_decode=uniform_decode, queries_per_seq=queries_per_seq, kv_scales=kv_scales)
        for g in range(len(model.kv_cache_groups))
    )
    mask = slot_mask(inp.lora_slots, max_loras, params["embed"].dtype) if lora else None
    with jax.default_matmul_precision(matmul_precision(params)):
        return forward(params, model, ids, inp.positions, kv, attend, lora, mask, inp.token_rows < num_rows,
                       moe_matmul(kernels, model))


def forward_step(
    params: Params, draft_params: Params, lora: Lora, state: RunnerState, inp: TokenInputs, *, model: ModelConfig,
    draft_model: ModelConfig | None, kernels: Kernels, uniform_decode: bool, spec_tokens: int, max_loras: int,
    kv_scales: tuple[float, float],
) -> tuple[jax.Array, jax.Array, RunnerState]:
    """(hidden states of each sequence's last 1 + spec_tokens tokens [S, 1 + k, H], of every token
    [T, H], the new state). Row i of a sequence is the hidden state after its i-th draft; the rows
    past its first 1 + num_drafts are junk."""
    inp = resolve_positions(state, inp)
    num_rows = state.token_ids.shape[0]
    rows = jnp.minimum(inp.token_rows, num_rows - 1)
    ids = jnp.where(inp.token_ids >= 0, inp.token_ids, state.token_ids[rows, inp.positions])
    token_ids = state.token_ids.at[inp.token_rows, inp.positions].set(ids, mode="drop")
    qps = 1 + spec_tokens
    hidden, kv = backbone(params, model, state.kv, state, inp, ids, kernels, uniform_decode, qps, kv_scales, lora,
                          max_loras)
    draft_kv = state.draft_kv
    if draft_model is not None:  # the draft model's pages follow the target's, token for token
        _, draft_kv = backbone(draft_params, draft_model, draft_kv, state, inp, ids, kernels, uniform_decode, qps,
                               kv_scales)
    first = inp.query_start_loc[1:] - 1 - jnp.minimum(inp.num_drafts, spec_tokens)
    index = jnp.clip(first[:, None] + jnp.arange(qps)[None, :], 0, hidden.shape[0] - 1)
    return hidden[index], hidden, dataclasses.replace(state, token_ids=token_ids, kv=kv, draft_kv=draft_kv)


def sample_step(
    params: Params, state: RunnerState, last_hidden: jax.Array, inp: SampleInputs, *, model: ModelConfig,
    kernels: Kernels, flags: SamplerFlags,
) -> tuple[SamplerOutput, RunnerState]:
    logits = full_logits(params, model, last_hidden[: inp.commit_rows.shape[0], 0])
    if flags.penalties or flags.bad_words:
        history = state.token_ids[inp.history_rows]
    else:
        history = jnp.zeros((logits.shape[0], 0), jnp.int32)
    out = sample(logits, inp.sampling, flags, history, kernels)
    token_ids = state.token_ids.at[inp.commit_rows, inp.sampling.positions].set(out.tokens, mode="drop")
    return out, dataclasses.replace(state, token_ids=token_ids)


def spec_sample_step(
    params: Params, draft_params: Params, state: RunnerState, last_hidden: jax.Array, inp: SampleInputs, *,
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
    b, k = inp.commit_rows.shape[0], spec.num_speculative_tokens
    k1, num_rows = 1 + k, state.token_ids.shape[0]
    logits = full_logits(params, model, last_hidden[:b].reshape(b * k1, -1)).astype(jnp.float32)
    slots = jnp.minimum(inp.history_rows, num_rows - 1)
    base = jnp.where(inp.relative, state.lens[slots] + inp.sampling.positions, inp.sampling.positions)
    positions = base[:, None] + jnp.arange(k1)[None, :]  # [B, 1 + k]
    md = jax.tree.map(lambda x: jnp.repeat(x, k1, axis=0), inp.sampling)
    masks = inp.sampling.grammar_bitmask
    md = dataclasses.replace(md, positions=positions.reshape(-1),
                             grammar_bitmask=masks.reshape(b * k1, masks.shape[1] // k1))
    history = (state.token_ids[jnp.repeat(inp.history_rows, k1)] if flags.penalties or flags.bad_words
               else jnp.zeros((b * k1, 0), jnp.int32))
    processed = process_logits(logits, md, flags, history, kernels)
    drafts = jnp.take_along_axis(state.token_ids[slots], jnp.clip(positions[:, :k], 0, state.token_ids.shape[1] - 1), axis=1)
    num_drafts = jnp.minimum(inp.num_drafts, k)
    tokens, num_kept = verify_drafts(processed, md, drafts, num_drafts, state.draft_probs[slots] if draft_model else None)

    kept = jnp.arange(k1)[None, :] < num_kept[:, None]
    committing = inp.commit_rows < num_rows
    cols = jnp.where(kept & committing[:, None], positions, state.token_ids.shape[1])  # out of range: dropped
    token_ids = state.token_ids.at[inp.commit_rows[:, None], cols].set(tokens, mode="drop")
    lens = state.lens.at[inp.commit_rows].set(base + num_kept, mode="drop")
    state = dataclasses.replace(state, token_ids=token_ids, lens=lens)
    state = propose(params, draft_params, state, inp, md, flags, committing, model=model, draft_model=draft_model,
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
        values, ids, ranks = compute_logprobs(source, flat, flags.num_logprobs, flags.logprobs_mode.endswith("logits"))

    def steps_first(x: jax.Array) -> jax.Array:  # [B * (1 + k), ...] -> [1 + k, B, ...]
        return jnp.swapaxes(x.reshape(b, k1, *x.shape[1:]), 0, 1)

    out = SamplerOutput(steps_first(flat), steps_first(values), steps_first(ids), steps_first(ranks),
                        steps_first(num_nans.reshape(-1)))
    return out, num_kept, next_drafts, state


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
        probs = state.draft_probs.at[token_rows, j].set(q, mode="drop")
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


def decode_round(
    tokens: TokenInputs, samples: SampleInputs, steps: jax.Array, j: jax.Array | int, num_rows: int
) -> tuple[TokenInputs, SampleInputs]:
    """The inputs of round j of a multi-step decode, from round 0's.

    Token i of the batch is request i's decode. Request i runs its first `steps[i]` rounds; in the
    rounds after, its token is padding (no KV written, no token committed) and its output unused.
    Round j > 0 reads every token from the device state, where round j - 1 committed it.
    """

    def per(n: int) -> jax.Array:  # steps per batch row, for [n]-shaped per-token or per-sequence arrays
        return jnp.zeros(n, jnp.int32).at[: min(n, steps.shape[0])].set(steps[:n])

    def offset(s: jax.Array) -> jax.Array:
        return jnp.minimum(j, jnp.maximum(s - 1, 0))

    steps_t, steps_s = per(tokens.token_ids.shape[0]), per(tokens.seq_lens.shape[0])
    tok = dataclasses.replace(
        tokens,
        token_ids=jnp.where(j == 0, tokens.token_ids, -1),
        token_rows=jnp.where(j < steps_t, tokens.token_rows, num_rows),
        positions=tokens.positions + offset(steps_t),
        seq_lens=tokens.seq_lens + offset(steps_s),
    )
    smp = dataclasses.replace(
        samples,
        commit_rows=jnp.where(j < steps, samples.commit_rows, num_rows),
        sampling=dataclasses.replace(samples.sampling, positions=samples.sampling.positions + offset(steps)),
    )
    return tok, smp


def decode_loop(
    params: Params,
    lora: Lora,
    state: RunnerState,
    tokens: TokenInputs,
    samples: SampleInputs,
    steps: jax.Array,
    *,
    model: ModelConfig,
    kernels: Kernels,
    flags: SamplerFlags,
    num_steps: int,
    uniform_decode: bool,
    max_loras: int,
    kv_scales: tuple[float, float],
) -> tuple[SamplerOutput, RunnerState]:
    """`num_steps` rounds of `decode_round` inputs through forward + sample in one call; outputs
    stacked [num_steps, B]."""

    def round_(state: RunnerState, j: jax.Array) -> tuple[RunnerState, SamplerOutput]:
        tok, smp = decode_round(tokens, samples, steps, j, state.token_ids.shape[0])
        last_hidden, _, state = forward_step(params, {}, lora, state, tok, model=model, draft_model=None, kernels=kernels,
                                             uniform_decode=uniform_decode, spec_tokens=0, max_loras=max_loras,
                                             kv_scales=kv_scales)
        out, state = sample_step(params, state, last_hidden, smp, model=model, kernels=kernels, flags=flags)
        return state, out

    state, outs = jax.lax.scan(round_, state, jnp.arange(num_steps))
    return outs, state


def prompt_logprobs_step(
    params: Params, hidden: jax.Array, rows: jax.Array, targets: jax.Array, *, model: ModelConfig, num_top: int, as_logits: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Logprobs of `targets` (and the top `num_top`) from the logits at hidden[rows]; raw logits, as vLLM."""
    return compute_logprobs(full_logits(params, model, hidden[rows]), targets, num_top, as_logits)
