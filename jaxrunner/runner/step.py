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
  sample, append the tokens that complete a request's known tokens to its row of `token_ids`.
  With speculative decoding `spec_decode.sample.spec_sample_step` runs in its place.
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
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxrunner.config import Kernels, ModelConfig
from jaxrunner.models import quantization
from jaxrunner.models.attention import AttentionMetadata, paged_attend
from jaxrunner.models.llama import MODEL_AXIS, HeadMatmul, Params, compute_logits, forward, head_product, slot_mask
from jaxrunner.models.moe import GroupedMatmul
from jaxrunner.models.quantization import Matmul
from jaxrunner.models.row_tiles import GROUPED_TILE_ROWS, fixed_tile_matmul, per_row, row_tiled
from jaxrunner.pytree import pytree_dataclass
from jaxrunner.runner.state import RunnerState
from jaxrunner.sampling import SamplerFlags, SamplerOutput, SamplingMetadata, compute_logprobs, sample
from pallas_kernels.grouped_matmul import grouped_matmul, grouped_matmul_in_tiles, supported
from pallas_kernels.quantized_matmul import grouped_dense_matmul, grouped_supported


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


def full_logits(params: Params, model: ModelConfig, hidden: jax.Array, product: HeadMatmul = head_product) -> jax.Array:
    """fp32 logits [N, vocab_size] of the hidden states, whole on every device. Under tensor
    parallelism each device computes its slice of the vocabulary (the LM head is split by it), then
    the slices are gathered, so the sampler works on full rows and the head's weight never moves;
    the padded vocabulary's extra columns are then cut off, so no token that does not exist is
    sampled, ranked or returned. `product`: the head's (`logits_matmul`)."""
    with jax.default_matmul_precision(matmul_precision(params)):
        logits = compute_logits(params, model, hidden, product)
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


def gather_blocks(pages: tuple, blocks: jax.Array, *, shards: int, pieces: int) -> tuple[jax.Array, ...]:
    """The blocks as a host tier keeps them, in `pieces` equal runs: the pages of every leaf of
    `pages` (the cache's and the draft's: the `(state.kv, state.draft_kv)` a host tier copies) as
    arrays of bytes [blocks, shards, bytes], each device's heads in its row, so that blocks move
    between the tiers in one copy each way whatever the model's layers. Several pieces in one
    program for the same reason as `scatter_blocks`."""
    packed = jnp.concatenate([_as_bytes(leaf[blocks], shards) for leaf in jax.tree.leaves(pages)], axis=2)
    return tuple(jnp.split(packed, pieces))


def stack_pieces(packed: tuple, *, rows: int) -> jax.Array:
    """Pieces of packed blocks that arrived from the host, each padded to `rows` rows, one after
    another in an array this program writes. `scatter_blocks` reads that array, not the pieces: a
    program that donates the cache and reads an array of a batch of copies still in flight can hold
    the host until the whole batch has arrived, and the steps behind it with it
    (`benchmarks/host_copies.py`). Padded, a smaller piece joins a group of the largest, and one
    scatter writes them all: a scatter's host cost is the cache's leaves, whatever its rows."""
    padded = [jnp.pad(piece, ((0, rows - piece.shape[0]), (0, 0), (0, 0))) for piece in packed]
    return jnp.concatenate(padded) if len(padded) > 1 else padded[0] + jnp.uint8(0)


def scatter_blocks(state: RunnerState, blocks: jax.Array, rows: jax.Array, *, shards: int) -> RunnerState:
    """`gather_blocks`'s inverse: write the packed blocks `rows` into the blocks (a block id past the
    cache: dropped). Several pieces in one program: the call's host cost grows with the cache's
    leaves, not with the pieces."""
    leaves, tree = jax.tree.flatten((state.kv, state.draft_kv))
    at, written = 0, []
    for leaf in leaves:
        size = math.prod(leaf.shape[1:]) * leaf.dtype.itemsize // shards
        written.append(leaf.at[blocks].set(_from_bytes(rows[:, :, at : at + size], leaf), mode="drop"))
        at += size
    kv, draft_kv = jax.tree.unflatten(tree, written)
    return dataclasses.replace(state, kv=kv, draft_kv=draft_kv)


def _as_bytes(pages: jax.Array, shards: int) -> jax.Array:
    """Pages [n, block_size, heads, head_dim] as bytes [n, shards, ...]: each shard's heads together."""
    n, size, heads, dim = pages.shape
    split = pages.reshape(n, size, shards, heads // shards, dim).transpose(0, 2, 1, 3, 4)
    return jax.lax.bitcast_convert_type(split, jnp.uint8).reshape(n, shards, -1)


def _from_bytes(rows: jax.Array, like: jax.Array) -> jax.Array:
    """`_as_bytes`'s inverse, for pages of `like`'s dtype and page shape."""
    _, size, heads, dim = like.shape
    n, shards, _ = rows.shape
    itemsize = () if like.dtype.itemsize == 1 else (like.dtype.itemsize,)
    split = jax.lax.bitcast_convert_type(rows.reshape(n, shards, size, heads // shards, dim, *itemsize), like.dtype)
    return split.transpose(0, 2, 1, 3, 4).reshape(n, size, heads, dim)


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
    `ragged_dot` reads every expert's weights), where its shapes allow, a decode's few rows with
    K spread over programs enough for two per SM (with `kernels.mosaic`, a decode's through the
    Mosaic GPU kernel); else `ragged_dot`.
    Batch-invariant, in tiles of GROUPED_TILE_ROWS rows (the kernel's, or the same tiles through
    XLA), so a row's products do not depend on what the batch routes beside it. Cached, so each
    choice is one object: the jitted decoder layer takes it as a static argument."""
    fixed = dict(block_m=GROUPED_TILE_ROWS) if kernels.batch_invariant else {}
    if kernels.pallas and supported(model.hidden_size, 2 * model.intermediate_size) and supported(
            model.intermediate_size, model.hidden_size):
        spread = {} if kernels.batch_invariant else dict(min_programs=2 * kernels.num_sms)
        triton = functools.partial(grouped_matmul, interpret=kernels.interpret, **fixed, **spread)
        if kernels.mosaic:
            return functools.partial(_mosaic_decode, triton, num_sms=kernels.num_sms, interpret=kernels.interpret)
        return triton
    return functools.partial(grouped_matmul_in_tiles, **fixed) if fixed else jax.lax.ragged_dot


def _mosaic_decode(wider: GroupedMatmul, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, num_sms: int,
                   interpret: bool) -> jax.Array:
    """A decode's few rows per expert through the Mosaic GPU kernel, which streams each expert's
    weight with TMA; a prefill's through `wider` (the shapes decide as the program traces)."""
    if grouped_supported(lhs.shape[0], rhs):
        return grouped_dense_matmul(lhs, rhs, group_sizes, num_sms=num_sms, interpret=interpret)
    return wider(lhs, rhs, group_sizes)


@functools.cache
def projection_matmul(kernels: Kernels) -> Matmul:
    """The layers' projections: with the Pallas kernels on a GPU, quantized weights' decode-shaped
    calls run the Mosaic kernel (`quantization.matmul`), and with `kernels.mosaic` bf16 weights'
    too; batch-invariant, tile by tile: in fixed tiles of the grouped matmul kernel with the Pallas
    kernels, else a loop of row tiles (`row_tiles`). Cached, as `moe_matmul`."""
    product = quantization.matmul
    if kernels.pallas and not kernels.interpret:
        product = functools.partial(quantization.matmul, num_sms=kernels.num_sms, dense=kernels.mosaic)
    if not kernels.batch_invariant:
        return product
    if kernels.pallas:
        return functools.partial(fixed_tile_matmul, product, interpret=kernels.interpret)
    return functools.partial(row_tiled, product)


@functools.cache
def logits_matmul(kernels: Kernels) -> HeadMatmul:
    """The LM head's product. Batch-invariant, in fixed tiles of the grouped matmul kernel with the
    Pallas kernels (the head, the largest weight, read once per 64 rows), else a loop of row tiles
    (`row_tiles`). Cached, as `moe_matmul`."""
    if not kernels.batch_invariant:
        return head_product

    def tiled(x: jax.Array, head: jax.Array, transposed: bool) -> jax.Array:
        product = functools.partial(head_product, transposed=transposed)
        if kernels.pallas:
            return fixed_tile_matmul(product, x, head, interpret=kernels.interpret, transposed=transposed,
                                     out_dtype=jnp.float32)
        return row_tiled(product, x, head)

    return tiled


def backbone(
    params: Params, model: ModelConfig, kv: tuple, state: RunnerState, inp: TokenInputs, ids: jax.Array,
    kernels: Kernels, uniform_decode: bool, queries_per_seq: int, kv_scales: tuple[float, float], lora: tuple = (),
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
                       moe_matmul(kernels, model), projection_matmul(kernels), kernels.batch_invariant)


def forward_step(
    params: Params, draft_params: Params, lora: tuple, state: RunnerState, tokens: TokenInputs, *, model: ModelConfig,
    draft_model: ModelConfig | None, kernels: Kernels, uniform_decode: bool, queries_per_seq: int, max_loras: int,
    kv_scales: tuple[float, float],
) -> tuple[jax.Array, jax.Array, RunnerState]:
    """(hidden states of each sequence's last `queries_per_seq` (1 + k) tokens [S, 1 + k, H], of every
    token [T, H], the new state). Row i of a sequence is the hidden state after its i-th draft; the rows
    past its first 1 + num_drafts are junk."""
    tokens = resolve_positions(state, tokens)
    num_rows = state.token_ids.shape[0]
    rows = jnp.minimum(tokens.token_rows, num_rows - 1)
    ids = jnp.where(tokens.token_ids >= 0, tokens.token_ids, state.token_ids[rows, tokens.positions])
    token_ids = state.token_ids.at[tokens.token_rows, tokens.positions].set(ids, mode="drop")
    qps = queries_per_seq
    hidden, kv = backbone(params, model, state.kv, state, tokens, ids, kernels, uniform_decode, qps, kv_scales, lora,
                          max_loras)
    draft_kv = state.draft_kv
    if draft_model is not None:  # the draft model's pages follow the target's, token for token
        _, draft_kv = backbone(draft_params, draft_model, draft_kv, state, tokens, ids, kernels, uniform_decode, qps,
                               kv_scales)
    first = tokens.query_start_loc[1:] - 1 - jnp.minimum(tokens.num_drafts, qps - 1)
    index = jnp.clip(first[:, None] + jnp.arange(qps)[None, :], 0, hidden.shape[0] - 1)
    return hidden[index], hidden, dataclasses.replace(state, token_ids=token_ids, kv=kv, draft_kv=draft_kv)


def sample_step(
    params: Params, token_ids: jax.Array, last_hidden: jax.Array, samples: SampleInputs, *, model: ModelConfig,
    kernels: Kernels, flags: SamplerFlags,
) -> tuple[SamplerOutput, jax.Array]:
    """Takes the state's token rows, not the whole state: a sampler's program then holds no KV cache
    among its arguments, so it neither depends on the cache's size nor passes its pages through."""
    logits = full_logits(params, model, last_hidden[: samples.commit_rows.shape[0], 0], logits_matmul(kernels))
    if flags.penalties or flags.bad_words:
        history = token_ids[samples.history_rows]
    else:
        history = jnp.zeros((logits.shape[0], 0), jnp.int32)
    def draw(rows: tuple) -> SamplerOutput:
        return sample(rows[0], rows[1], flags, rows[2], kernels)

    out = per_row(draw, (logits, samples.sampling, history), kernels.batch_invariant and flags.sums_rows)
    return out, token_ids.at[samples.commit_rows, samples.sampling.positions].set(out.tokens, mode="drop")


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
    lora: tuple,
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
                                             uniform_decode=uniform_decode, queries_per_seq=1, max_loras=max_loras,
                                             kv_scales=kv_scales)
        out, token_ids = sample_step(params, state.token_ids, last_hidden, smp, model=model, kernels=kernels,
                                     flags=flags)
        return dataclasses.replace(state, token_ids=token_ids), out

    state, outs = jax.lax.scan(round_, state, jnp.arange(num_steps))
    return outs, state


def prompt_logprobs_step(
    params: Params, hidden: jax.Array, rows: jax.Array, targets: jax.Array, *, model: ModelConfig, kernels: Kernels,
    num_top: int, as_logits: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Logprobs of `targets` (and the top `num_top`) from the logits at hidden[rows]; raw logits, as vLLM."""
    logits = full_logits(params, model, hidden[rows], logits_matmul(kernels))
    return per_row(lambda r: compute_logprobs(r[0], r[1], num_top, as_logits), (logits, targets), kernels.batch_invariant)
