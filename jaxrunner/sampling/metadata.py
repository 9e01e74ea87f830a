"""Host side of the sampler: pack each request once, then one bucket's metadata every step.

`prepare_request` turns a request's SamplingParams into a `RequestSampling` when the request
arrives (and raises a ValueError for anything the engine's limits rule out). Every step,
`build_sampling_metadata` stacks the bucket's rows into numpy arrays (`SamplingMetadata`, padded to
the bucket) and says, in a hashable `SamplerFlags`, which features the batch needs: the flags are a
static argument of the jitted sampler, so a batch only pays for the features some row uses.

Variable-width data (logit bias, allowed ids, min-tokens stop ids, bad words, grammar masks)
travels in arrays of a fixed width (from `SamplerConfig`; ceil(V / 32) words per mask) when its flag
is on, and of width 0 when it is off; the flags therefore fix every shape, and the number of graphs
is the number of distinct flags per request bucket. Passing `variants` (e.g.
`flag_variants(config, vocab_size)`, 12 of them) promotes each batch to the first variant that
covers it, so exactly those graphs arise; without `variants` a graph arises per combination
actually met (at most 2**9 per bucket).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np

from jaxrunner.config import SamplerConfig
from jaxrunner.pytree import pytree_dataclass
from jaxrunner.sampling_params import SamplingParams

NO_LOGPROBS = -1
SCALARS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
# Per-request lists and the metadata columns they fill (min_tokens' stop ids are handled apart).
LIST_COLUMNS = (
    ("logit_bias", ("bias_token_ids", "bias_values")),
    ("allowed_token_ids", ("allowed_token_ids",)),
    ("bad_words", ("bad_words",)),
)
FEATURES = ("penalties", "top_k_top_p", "min_p", "logit_bias", "allowed_token_ids", "bad_words", "min_tokens", "grammar")


@dataclass(frozen=True)
class SamplerFlags:
    """Static switches of one sampler graph: the features some row of the batch needs.

    A feature switched on for a row that does not use it is a no-op (the row's parameters are
    neutral), so a graph with more features serves any batch that needs fewer: see `covers`.
    `num_logprobs` is the number of top-logprob columns beside the sampled token (-1: none).
    """

    penalties: bool = False
    top_k_top_p: bool = False
    min_p: bool = False
    logit_bias: bool = False
    allowed_token_ids: bool = False
    bad_words: bool = False
    min_tokens: bool = False
    grammar: bool = False  # some row has a grammar mask (structured output)
    num_logprobs: int = NO_LOGPROBS
    logprobs_mode: str = SamplerConfig.logprobs_mode
    count_nans: bool = False

    @property
    def sums_rows(self) -> bool:
        """Whether the graph adds up a row: top-p's running sum, the logprobs' normaliser. A sum's
        order can follow the batch's shape; everything else it does to a row (maxima, argmax,
        gathers, integer counts, elementwise arithmetic) is exact in any batch."""
        return self.top_k_top_p or self.num_logprobs != NO_LOGPROBS

    def covers(self, needed: SamplerFlags) -> bool:
        return (
            all(getattr(self, f) or not getattr(needed, f) for f in FEATURES)
            and needed.num_logprobs in (NO_LOGPROBS, self.num_logprobs)
            and (self.logprobs_mode, self.count_nans) == (needed.logprobs_mode, needed.count_nans)
        )

    def union(self, other: SamplerFlags) -> SamplerFlags:
        on = {f: getattr(self, f) or getattr(other, f) for f in FEATURES}
        return dataclasses.replace(self, **on, num_logprobs=max(self.num_logprobs, other.num_logprobs))


@functools.cache  # asked every step; the answer depends on the engine-wide config only
def flag_variants(config: SamplerConfig, vocab_size: int) -> tuple[SamplerFlags, ...]:
    """A small covering set of graphs, cheapest first: plain, truncation (top-k/top-p/min-p),
    everything; each without and with logprobs; then the six again with grammar masks. The last
    covers every batch."""
    plain = SamplerFlags(logprobs_mode=config.logprobs_mode, count_nans=config.count_nans)
    truncation = dataclasses.replace(plain, top_k_top_p=True, min_p=True)
    everything = dataclasses.replace(plain, **{f: f != "grammar" for f in FEATURES})
    with_logprobs = functools.partial(dataclasses.replace, num_logprobs=config.logprobs_width(vocab_size))
    base = tuple(v for f in (plain, truncation, everything) for v in (f, with_logprobs(f)))
    return base + tuple(dataclasses.replace(v, grammar=True) for v in base)


@pytree_dataclass
class SamplingMetadata:
    """Per-row sampling inputs of one request bucket ([B] rows; numpy on the host, jax on device).

    Padding rows and unused features hold neutral values: greedy, top_k = V, top_p = 1, min_p = 0,
    no penalty, list entries pointing past the vocabulary (dropped by the scatters).
    """

    temperature: jax.Array  # f32 [B]; 0 = greedy
    seeds: jax.Array  # u32 [B, 2]: a 64-bit seed as threefry key data
    positions: jax.Array  # i32 [B]: position of the token being sampled (= tokens before it)
    prompt_lens: jax.Array  # i32 [B]
    top_k: jax.Array  # i32 [B]; V = off
    top_p: jax.Array  # f32 [B]; 1 = off
    min_p: jax.Array  # f32 [B]; 0 = off
    repetition_penalty: jax.Array  # f32 [B]; 1 = off
    frequency_penalty: jax.Array  # f32 [B]
    presence_penalty: jax.Array  # f32 [B]
    bias_token_ids: jax.Array  # i32 [B, Wb]; V = unused entry
    bias_values: jax.Array  # f32 [B, Wb]
    allowed_token_ids: jax.Array  # i32 [B, Wa]; V = unused; a row with no entry allows every token
    stop_token_ids: jax.Array  # i32 [B, Ws]; banned while positions < min_lens (min_tokens); V = unused
    min_lens: jax.Array  # i32 [B]: prompt_len + min_tokens
    bad_words: jax.Array  # i32 [B, Nw, Lw]: token ids right-aligned, -1 before a word and in unused words
    # i32 [B, M * W]: M grammar masks of W = ceil(V / 32) words per row (one per token it may sample:
    # M = 1 + k with k drafts); bit j of word i allows token 32 i + j; -1 (all allowed) without a grammar
    grammar_bitmask: jax.Array


@dataclass(frozen=True)
class RequestSampling:
    """One request's sampling parameters, packed once when it arrives."""

    temperature: float  # 0 = greedy
    seed: int  # 64-bit
    prompt_len: int
    top_k: int  # V = off
    top_p: float
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    min_len: int  # stop tokens are banned while the sampled position is below prompt_len + min_tokens
    num_logprobs: int  # top logprobs wanted beside the sampled token's; -1: none
    bias_token_ids: np.ndarray  # i32 [n]
    bias_values: np.ndarray  # f32 [n]
    allowed_token_ids: np.ndarray  # i32 [n]; empty: every token
    stop_token_ids: np.ndarray  # i32 [n]; stop_token_ids and EOS, only when min_tokens > 0
    bad_words: np.ndarray  # i32 [n, max_bad_word_len], right-aligned, -1 before the word
    features: frozenset[str]  # names from FEATURES the request needs (min_tokens: while below min_len)


def prepare_request(
    params: SamplingParams, seed: int, prompt_len: int, config: SamplerConfig, vocab_size: int,
    eos_token_ids: tuple[int, ...] = (),
) -> RequestSampling:
    """Pack a request's parameters; ValueError if the model or the engine's limits rule them out.

    `seed` is params.seed, or one the runner drew for an unseeded request. Under min_tokens the
    stop token ids and `eos_token_ids` (the model's) are banned.
    """
    params.verify(vocab_size, config.max_logprobs)
    bias = params.logit_bias or {}
    allowed = params.allowed_token_ids or []
    stops = sorted(set(params.stop_token_ids or []) | set(eos_token_ids)) if params.min_tokens else []
    words = params.bad_words_token_ids or []
    for name, count, limit in (
        ("logit_bias entries", len(bias), config.max_logit_bias),
        ("allowed_token_ids", len(allowed), config.max_allowed_token_ids),
        ("stop token ids (with EOS) under min_tokens", len(stops), config.max_stop_token_ids),
        ("bad words", len(words), config.max_bad_words),
        ("tokens in one bad word", max(map(len, words), default=0), config.max_bad_word_len),
    ):
        if count > limit:
            hint = "; raise the engine argument max_bad_word_len" if name == "tokens in one bad word" else ""
            raise ValueError(f"SamplingParams: {count} {name} exceed the engine's maximum of {limit}{hint}")
    bad_words = np.full((len(words), config.max_bad_word_len), -1, np.int32)
    for i, word in enumerate(words):
        bad_words[i, config.max_bad_word_len - len(word) :] = word
    top_k = vocab_size if params.top_k == -1 else min(params.top_k, vocab_size)
    num_logprobs = NO_LOGPROBS if params.logprobs is None else vocab_size if params.logprobs == -1 else params.logprobs
    penalties = (params.repetition_penalty, params.frequency_penalty, params.presence_penalty) != (1.0, 0.0, 0.0)
    wanted = {
        "penalties": penalties,
        "top_k_top_p": top_k < vocab_size or params.top_p < 1.0,
        "min_p": params.min_p > 0.0,
        "logit_bias": bool(bias),
        "allowed_token_ids": bool(allowed),
        "bad_words": bool(words),
        "min_tokens": bool(stops),
    }
    return RequestSampling(
        temperature=0.0 if params.greedy else float(params.temperature),
        seed=seed,
        prompt_len=prompt_len,
        top_k=top_k,
        top_p=float(params.top_p),
        min_p=float(params.min_p),
        repetition_penalty=float(params.repetition_penalty),
        frequency_penalty=float(params.frequency_penalty),
        presence_penalty=float(params.presence_penalty),
        min_len=prompt_len + params.min_tokens,
        num_logprobs=num_logprobs,
        bias_token_ids=np.array(list(bias), np.int32),
        bias_values=np.array(list(bias.values()), np.float32),
        allowed_token_ids=np.array(allowed, np.int32),
        stop_token_ids=np.array(stops, np.int32),
        bad_words=bad_words,
        features=frozenset(f for f, on in wanted.items() if on),
    )


def build_sampling_metadata(
    requests: Sequence[RequestSampling],
    positions: Sequence[int],
    num_rows: int,
    config: SamplerConfig,
    vocab_size: int,
    variants: Sequence[SamplerFlags] = (),
    grammar_bitmask: np.ndarray | None = None,
    masks_per_row: int = 1,
) -> tuple[SamplingMetadata, SamplerFlags]:
    """Numpy metadata for a bucket of `num_rows` rows (the first len(requests) used) and its flags.

    `positions[i]` is the position of the token row i samples (a lower bound will do: the stop-token
    ban of min_tokens is checked again on the device, against the row's true position). With `variants`, the flags are the
    first variant that covers the batch (the batch's own flags if none does). `grammar_bitmask`
    (i32 [len(requests), masks_per_row * ceil(V / 32)]) holds the rows' grammar masks, when some row has one.
    """
    n = len(requests)
    if n > num_rows or len(positions) != n:
        raise ValueError(f"{n} requests and {len(positions)} positions for a bucket of {num_rows} rows")
    banning = [i for i, r in enumerate(requests) if "min_tokens" in r.features and positions[i] < r.min_len]
    features = set().union(*(r.features for r in requests)) - {"min_tokens"}
    if banning:
        features.add("min_tokens")
    if grammar_bitmask is not None:
        features.add("grammar")
    wants_logprobs = any(r.num_logprobs != NO_LOGPROBS for r in requests)
    needed = SamplerFlags(
        **{f: f in features for f in FEATURES},
        num_logprobs=config.logprobs_width(vocab_size) if wants_logprobs else NO_LOGPROBS,
        logprobs_mode=config.logprobs_mode,
        count_nans=config.count_nans,
    )
    flags = next((v for v in variants if v.covers(needed)), needed)

    md = neutral_metadata(num_rows, config, vocab_size, flags, masks_per_row)
    if grammar_bitmask is not None:
        md.grammar_bitmask[:n] = grammar_bitmask
    for name in SCALARS:
        getattr(md, name)[:n] = [getattr(r, name) for r in requests]
    seeds = np.array([r.seed for r in requests], np.uint64)
    md.seeds[:n, 0], md.seeds[:n, 1] = seeds >> np.uint64(32), seeds & np.uint64(0xFFFFFFFF)
    md.positions[:n] = positions
    md.prompt_lens[:n] = [r.prompt_len for r in requests]
    md.min_lens[:n] = [r.min_len for r in requests]
    for feature, columns in LIST_COLUMNS:
        rows = [i for i, r in enumerate(requests) if feature in r.features] if feature in features else []
        for i in rows:
            for column in columns:
                value = getattr(requests[i], column)
                getattr(md, column)[i, : len(value)] = value
    for i in banning:
        md.stop_token_ids[i, : len(requests[i].stop_token_ids)] = requests[i].stop_token_ids
    return md, flags


def neutral_metadata(
    num_rows: int, config: SamplerConfig, vocab_size: int, flags: SamplerFlags, masks_per_row: int = 1
) -> SamplingMetadata:
    """Metadata of `num_rows` padding rows shaped for `flags` (also the example input for AOT compiles)."""
    vocab, b = vocab_size, num_rows

    def width(on: bool, w: int) -> int:
        return w if on else 0

    return SamplingMetadata(
        temperature=np.zeros(b, np.float32),
        seeds=np.zeros((b, 2), np.uint32),
        positions=np.zeros(b, np.int32),
        prompt_lens=np.zeros(b, np.int32),
        top_k=np.full(b, vocab, np.int32),
        top_p=np.ones(b, np.float32),
        min_p=np.zeros(b, np.float32),
        repetition_penalty=np.ones(b, np.float32),
        frequency_penalty=np.zeros(b, np.float32),
        presence_penalty=np.zeros(b, np.float32),
        bias_token_ids=np.full((b, width(flags.logit_bias, config.max_logit_bias)), vocab, np.int32),
        bias_values=np.zeros((b, width(flags.logit_bias, config.max_logit_bias)), np.float32),
        allowed_token_ids=np.full((b, width(flags.allowed_token_ids, config.max_allowed_token_ids)), vocab, np.int32),
        stop_token_ids=np.full((b, width(flags.min_tokens, config.max_stop_token_ids)), vocab, np.int32),
        min_lens=np.zeros(b, np.int32),
        bad_words=np.full(
            (b, width(flags.bad_words, config.max_bad_words), config.max_bad_word_len if flags.bad_words else 0),
            -1,
            np.int32,
        ),
        grammar_bitmask=np.full((b, width(flags.grammar, masks_per_row * mask_words(vocab))), -1, np.int32),
    )


def mask_words(vocab_size: int) -> int:
    """int32 words in one grammar mask: a bit per token."""
    return (vocab_size + 31) // 32
