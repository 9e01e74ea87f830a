"""The device side of a step: pure functions over the donated RunnerState, and their input pytrees.

- `write_block_rows`: copy changed block-table rows in (only on steps where some request got blocks).
- `forward_step` (one graph per token bucket, and one more per bucket that holds only decodes, for
  the decode-specialised attention): gather input ids, write KV, run the model, keep the hidden
  state of each sequence's last token ([S] rows, S = max_num_seqs).
- `sample_step` (one graph per request bucket and sampler variant): logits for the batch's rows,
  sample, append the tokens that complete a request's known tokens to its row.
- `decode_loop` (multi-step decode, one graph per request bucket, sampler variant and step count):
  `num_steps` rounds of forward + sample in one device call, each feeding its tokens to the next.
- `prompt_logprobs_step` (one graph, fixed chunk): logprobs of prompt tokens from the backbone's
  hidden states, for requests that ask for prompt logprobs.
Splitting at the last-token hidden states keeps the number of graphs at T + R, not T x R.
`programs.py` compiles each of them per bucket and option; `kernels` (a static `Kernels`) says
whether the Pallas kernels or the jnp references run.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrunner.attention import AttentionMetadata, paged_attend
from jaxrunner.config import Kernels, ModelConfig
from jaxrunner.models.llama import Params, compute_logits, forward
from jaxrunner.pytree import pytree_dataclass
from jaxrunner.sampling import SamplerFlags, SamplerOutput, SamplingMetadata, compute_logprobs, sample
from jaxrunner.state import RunnerState


@pytree_dataclass
class TokenInputs:
    """Per-token ([T]) and per-sequence ([S] = max_num_seqs) inputs of the backbone."""

    token_ids: jax.Array  # i32 [T]; -1: read the token from the device state (a sampled token)
    token_rows: jax.Array  # i32 [T]; the request slot; max_num_seqs for padding
    positions: jax.Array  # i32 [T]
    query_start_loc: jax.Array  # i32 [S + 1]
    seq_lens: jax.Array  # i32 [S]
    seq_rows: jax.Array  # i32 [S]
    num_seqs: jax.Array  # i32 []


@pytree_dataclass
class SampleInputs:
    """Per-request ([B]) inputs of the logits + sampler step."""

    commit_rows: jax.Array  # i32 [B]; slot to append the sampled token to; max_num_seqs: discard
    history_rows: jax.Array  # i32 [B]; slot whose token row penalties and bad words read
    sampling: SamplingMetadata


def matmul_precision(params: Params) -> str:
    """fp32 models get true fp32 matmuls (GPUs would otherwise use TF32 and break fp32 parity)."""
    return "highest" if params["embed"].dtype == jnp.float32 else "default"


def write_block_rows(state: RunnerState, slots: jax.Array, rows: jax.Array) -> RunnerState:
    table = state.block_table.at[slots].set(rows, mode="drop")
    return dataclasses.replace(state, block_table=table)


def forward_step(
    params: Params, state: RunnerState, inp: TokenInputs, *, model: ModelConfig, kernels: Kernels, uniform_decode: bool
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
        hidden, kv = forward(params, model, ids, inp.positions, state.kv, paged_attend(model, md, kernels, uniform_decode=uniform_decode))
    last = hidden[jnp.maximum(inp.query_start_loc[1:] - 1, 0)]
    return last, hidden, dataclasses.replace(state, token_ids=token_ids, kv=kv)


def sample_step(
    params: Params, state: RunnerState, last_hidden: jax.Array, inp: SampleInputs, *, model: ModelConfig,
    kernels: Kernels, flags: SamplerFlags,
) -> tuple[SamplerOutput, RunnerState]:
    with jax.default_matmul_precision(matmul_precision(params)):
        logits = compute_logits(params, model, last_hidden[: inp.commit_rows.shape[0]])
    if flags.penalties or flags.bad_words:
        history = state.token_ids[inp.history_rows]
    else:
        history = jnp.zeros((logits.shape[0], 0), jnp.int32)
    out = sample(logits, inp.sampling, flags, history, kernels)
    token_ids = state.token_ids.at[inp.commit_rows, inp.sampling.positions].set(out.tokens, mode="drop")
    return out, dataclasses.replace(state, token_ids=token_ids)


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
    smp = SampleInputs(
        commit_rows=jnp.where(j < steps, samples.commit_rows, num_rows),
        history_rows=samples.history_rows,
        sampling=dataclasses.replace(samples.sampling, positions=samples.sampling.positions + offset(steps)),
    )
    return tok, smp


def decode_loop(
    params: Params,
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
) -> tuple[SamplerOutput, RunnerState]:
    """`num_steps` rounds of `decode_round` inputs through forward + sample in one call; outputs
    stacked [num_steps, B]."""

    def round_(state: RunnerState, j: jax.Array) -> tuple[RunnerState, SamplerOutput]:
        tok, smp = decode_round(tokens, samples, steps, j, state.token_ids.shape[0])
        last_hidden, _, state = forward_step(params, state, tok, model=model, kernels=kernels, uniform_decode=uniform_decode)
        out, state = sample_step(params, state, last_hidden, smp, model=model, kernels=kernels, flags=flags)
        return state, out

    state, outs = jax.lax.scan(round_, state, jnp.arange(num_steps))
    return outs, state


def prompt_logprobs_step(
    params: Params, hidden: jax.Array, rows: jax.Array, targets: jax.Array, *, model: ModelConfig, num_top: int, as_logits: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Logprobs of `targets` (and the top `num_top`) from the logits at hidden[rows]; raw logits, as vLLM."""
    with jax.default_matmul_precision(matmul_precision(params)):
        logits = compute_logits(params, model, hidden[rows])
    return compute_logprobs(logits, targets, num_top, as_logits)
