"""The device side of the sampler: logits processing in vLLM's order, Gumbel-max sampling, logprobs.

Order (vLLM model runner v2): NaN -> -inf; grammar masks (structured output); allowed token ids; logit bias; min-tokens stop bans;
repetition/frequency/presence penalties; bad words; temperature (greedy rows keep T = 1); min-p;
top-k then top-p; then argmax(logits + Gumbel noise), or plain argmax for greedy rows.

Each feature runs only when its static flag is on, and is a no-op for rows with neutral
parameters. Penalties and bad words read each row's token history (prompt, then generated
tokens) and count it on the fly with a scatter-add into [B, V]: no per-request count table.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrunner.config import Kernels
from jaxrunner.pytree import pytree_dataclass
from jaxrunner.sampling.logprobs import compute_logprobs
from jaxrunner.sampling.metadata import NO_LOGPROBS, SamplerFlags, SamplingMetadata
from jaxrunner.sampling.truncation import top_k_top_p


@pytree_dataclass
class SamplerOutput:
    """What one sampler call returns for [B] rows; K = 1 + flags.num_logprobs, or 0 without logprobs."""

    tokens: jax.Array  # i32 [B]
    logprobs: jax.Array  # f32 [B, K]: the sampled token's, then the top ones
    logprob_token_ids: jax.Array  # i32 [B, K]
    ranks: jax.Array  # i32 [B]: rank of the sampled token (0 without logprobs)
    num_nans: jax.Array  # i32 [B]: NaNs in the row's logits (0 unless flags.count_nans)


def sample(
    logits: jax.Array, md: SamplingMetadata, flags: SamplerFlags, history: jax.Array, kernels: Kernels
) -> SamplerOutput:
    """Sample one token per row of logits [B, V].

    `history` i32 [B, L] holds each row's tokens (prompt, then generated); the first
    md.positions[b] are valid. Only penalties and bad words read it (pass [B, 0] otherwise).
    """
    batch = logits.shape[0]
    logits = logits.astype(jnp.float32)
    processed = process_logits(logits, md, flags, history, kernels)
    greedy = (md.temperature == 0.0)[:, None]
    noisy = jnp.where(greedy, processed, processed + gumbel_noise(md.seeds, md.positions, logits.shape[1]))
    tokens = jnp.argmax(noisy, axis=1).astype(jnp.int32)

    zeros = jnp.zeros(batch, jnp.int32)
    num_nans = jnp.sum(jnp.isnan(logits), axis=1, dtype=jnp.int32) if flags.count_nans else zeros
    if flags.num_logprobs == NO_LOGPROBS:
        empty = jnp.zeros((batch, 0), jnp.float32)
        return SamplerOutput(tokens, empty, empty.astype(jnp.int32), zeros, num_nans)
    source = processed if flags.logprobs_mode.startswith("processed") else logits
    values, ids, ranks = compute_logprobs(source, tokens, flags.num_logprobs, flags.logprobs_mode.endswith("logits"))
    return SamplerOutput(tokens, values, ids, ranks, num_nans)


def process_logits(
    logits: jax.Array, md: SamplingMetadata, flags: SamplerFlags, history: jax.Array, kernels: Kernels
) -> jax.Array:
    """f32 logits [B, V] after every sampling parameter: what the sample is drawn from."""
    batch, vocab = logits.shape
    rows = jnp.arange(batch)[:, None]
    x = jnp.where(jnp.isnan(logits), -jnp.inf, logits)
    if flags.grammar:
        x = apply_grammar_bitmask(x, md.grammar_bitmask)
    if flags.allowed_token_ids:
        allowed = jnp.zeros((batch, vocab), bool).at[rows, md.allowed_token_ids].set(True, mode="drop")
        restricted = jnp.any(md.allowed_token_ids < vocab, axis=1, keepdims=True)
        x = jnp.where(allowed | ~restricted, x, -jnp.inf)
    if flags.logit_bias:
        x = x.at[rows, md.bias_token_ids].add(md.bias_values, mode="drop")
    if flags.min_tokens:
        banned = jnp.where((md.positions < md.min_lens)[:, None], md.stop_token_ids, vocab)
        x = x.at[rows, banned].set(-jnp.inf, mode="drop")
    if flags.penalties:
        x = apply_penalties(x, md, history)
    if flags.bad_words:
        x = ban_bad_words(x, md, history)
    x = x / jnp.where(md.temperature == 0.0, 1.0, md.temperature)[:, None]
    if flags.min_p:
        floor = jnp.max(x, axis=1, keepdims=True) + jnp.log(md.min_p)[:, None]
        x = jnp.where(x < floor, -jnp.inf, x)
    if flags.top_k_top_p:
        x = top_k_top_p(x, md.top_k, md.top_p, kernels)
    return x


def apply_grammar_bitmask(x: jax.Array, bitmask: jax.Array) -> jax.Array:
    """-inf where the row's mask (i32 [B, ceil(V / 32)], bit j of word i for token 32 i + j) says no."""
    batch, vocab = x.shape
    bits = jnp.right_shift(bitmask[:, :, None], jnp.arange(32, dtype=jnp.int32)) & 1  # [B, W, 32]
    return jnp.where(bits.reshape(batch, -1)[:, :vocab] == 1, x, -jnp.inf)


def apply_penalties(x: jax.Array, md: SamplingMetadata, history: jax.Array) -> jax.Array:
    """vLLM's penalties. Repetition: tokens seen in the prompt or the output have positive logits
    divided and negative ones multiplied by it. Frequency subtracts f * (count in the output),
    presence subtracts p once a token is in the output."""
    batch, vocab = x.shape
    rows = jnp.arange(batch)[:, None]
    index = jnp.arange(history.shape[1])[None, :]
    valid = (index < md.positions[:, None]) & (history >= 0) & (history < vocab)
    in_output = valid & (index >= md.prompt_lens[:, None])
    output_ids, prompt_ids = jnp.where(in_output, history, vocab), jnp.where(valid & ~in_output, history, vocab)
    output_counts = jnp.zeros((batch, vocab), jnp.int32).at[rows, output_ids].add(1, mode="drop")
    in_prompt = jnp.zeros((batch, vocab), bool).at[rows, prompt_ids].set(True, mode="drop")
    in_output = output_counts > 0
    rep = md.repetition_penalty[:, None]
    x = jnp.where(in_prompt | in_output, jnp.where(x > 0, x / rep, x * rep), x)
    return x - md.frequency_penalty[:, None] * output_counts - md.presence_penalty[:, None] * in_output


def ban_bad_words(x: jax.Array, md: SamplingMetadata, history: jax.Array) -> jax.Array:
    """Ban each bad word's last token where the generated tokens end with the rest of the word.

    md.bad_words [B, Nw, Lw] holds the words right-aligned; the prefix (all but the last column) is
    compared with the last Lw - 1 tokens before the sampled position, which must all be outputs.
    """
    batch, vocab = x.shape
    word_len = md.bad_words.shape[2]
    index = md.positions[:, None] - (word_len - 1) + jnp.arange(word_len - 1)[None, :]
    tail = jnp.take_along_axis(history, jnp.clip(index, 0, history.shape[1] - 1), axis=1)
    tail = jnp.where((index >= md.prompt_lens[:, None]) & (index >= 0), tail, -2)  # -2 matches no token and no padding
    prefix, last = md.bad_words[:, :, :-1], md.bad_words[:, :, -1]
    matched = jnp.all((prefix == -1) | (prefix == tail[:, None, :]), axis=2) & (last >= 0)
    rows = jnp.arange(batch)[:, None]
    return x.at[rows, jnp.where(matched, last, vocab)].set(-jnp.inf, mode="drop")


def gumbel_noise(seeds: jax.Array, positions: jax.Array, vocab_size: int, stream: int = 0) -> jax.Array:
    """Gumbel noise [B, V] that depends only on each row's (seed, position) and the `stream`.

    Built from 32 random bits per token as -log(-log1p(-u)), u in (0, 1): the largest value is
    ~22 (jax.random.gumbel's default stops at ~16), so tokens ~e^-20 below the best still win at
    their true rate. Stream 0 is plain sampling's (speculative decoding draws the drafts' and the
    bonus token's from it too); the rejection sampler's other draws use streams of their own.
    """
    return -jnp.log(-jnp.log1p(-uniform_noise(seeds, positions, vocab_size, stream)))


def uniform_noise(seeds: jax.Array, positions: jax.Array, width: int, stream: int = 0) -> jax.Array:
    """Uniform noise in (0, 1), [B, width], from each row's (seed, position, stream)."""

    def row(seed: jax.Array, pos: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.wrap_key_data(seed, impl="threefry2x32"), pos)
        if stream:
            key = jax.random.fold_in(key, stream)
        return jax.random.bits(key, (width,), jnp.uint32)

    bits = jax.vmap(row)(seeds, positions)
    return jnp.minimum((bits.astype(jnp.float32) + 0.5) * 2.0**-32, 1.0 - 2.0**-24)
