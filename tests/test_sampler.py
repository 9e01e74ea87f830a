"""The sampler against numpy references of vLLM's semantics, and its statistics.

Statistical tests draw >= 100k samples per case in one jitted call (one row per sample, each at its
own position) and compare the token counts with the exact target distribution by chi-square.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrunner.config import Kernels, SamplerConfig
from jaxrunner.sampling import (
    PromptLogprobsBuffer,
    SamplerFlags,
    build_sampling_metadata,
    compute_logprobs,
    flag_variants,
    neutral_metadata,
    prepare_request,
    process_logits,
    prompt_logprob_positions,
    sample,
)
from jaxrunner.sampling.logprobs import top_ids
from jaxrunner.sampling.truncation import top_k_top_p
from jaxrunner.sampling_params import SamplingParams
from jaxrunner.step_io import LogprobsArrays
from pallas_kernels.sampler_tally import NUM_CANDIDATES, ordered_keys, padded_vocab, tally_kernel, tally_reference

REFERENCE = Kernels(pallas=False, interpret=True, num_sms=132)
PALLAS = Kernels(pallas=True, interpret=True, num_sms=132)  # interpreted: runs on the CPU
sample_jit = jax.jit(lambda logits, md, flags, history: sample(logits, md, flags, history, REFERENCE), static_argnums=2)
process_jit = jax.jit(lambda logits, md, flags, history: process_logits(logits, md, flags, history, REFERENCE),
                      static_argnums=2)


@dataclasses.dataclass(frozen=True)
class Spec:
    """Sampler settings with the model facts they serve: the vocabulary and the EOS ids."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    config: SamplerConfig

    def __getattr__(self, name: str):
        return getattr(self.config, name)

    def replace(self, **settings) -> Spec:
        return dataclasses.replace(self, config=dataclasses.replace(self.config, **settings))


def spec(vocab_size: int, eos_token_ids: tuple[int, ...] = (), **settings) -> Spec:
    return Spec(vocab_size, eos_token_ids, SamplerConfig(**settings))


def prepare(params: SamplingParams, seed: int, prompt_len: int, s: Spec):
    return prepare_request(params, seed, prompt_len, s.config, s.vocab_size, s.eos_token_ids)


def covering(s: Spec):
    return flag_variants(s.config, s.vocab_size)


def neutral(num_rows: int, s: Spec, flags: SamplerFlags):
    return neutral_metadata(num_rows, s.config, s.vocab_size, flags)


def metadata(requests, positions, num_rows: int, s: Spec, flag_options=()):
    return build_sampling_metadata(requests, positions, num_rows, s.config, s.vocab_size, flag_options)


# ---------------------------------------------------------------- numpy reference (vLLM semantics)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))


def reference_logits(
    logits: np.ndarray, params: SamplingParams, history: np.ndarray, position: int, prompt_len: int, eos=()
) -> np.ndarray:
    """One row through vLLM's pipeline, written plainly (sorts for top-k and top-p)."""
    vocab = logits.shape[0]
    x = np.where(np.isnan(logits), -np.inf, logits).astype(np.float32)
    if params.allowed_token_ids:
        keep = np.zeros(vocab, bool)
        keep[params.allowed_token_ids] = True
        x = np.where(keep, x, -np.inf).astype(np.float32)
    for token, bias in (params.logit_bias or {}).items():
        x[token] += np.float32(bias)
    if position - prompt_len < params.min_tokens:
        x[sorted(set(params.stop_token_ids or []) | set(eos))] = -np.inf
    prompt, output = history[:prompt_len], history[prompt_len:position]
    counts = np.bincount(output, minlength=vocab)
    seen = counts > 0
    seen[prompt] = True
    rep = np.float32(params.repetition_penalty)
    x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
    x = x - np.float32(params.frequency_penalty) * counts - np.float32(params.presence_penalty) * (counts > 0)
    x = x.astype(np.float32)
    for word in params.bad_words_token_ids or []:
        prefix = list(word[:-1])
        if len(prefix) <= len(output) and list(output[len(output) - len(prefix) :]) == prefix:
            x[word[-1]] = -np.inf
    if not params.greedy:
        x = x / np.float32(params.temperature)
    if params.min_p > 0:
        x = np.where(x < x.max() + np.log(np.float32(params.min_p)), -np.inf, x)
    if 0 < params.top_k < vocab:
        kth = np.sort(x)[::-1][params.top_k - 1]
        x = np.where(x < kth, -np.inf, x)
    if params.top_p < 1:
        order = np.argsort(x, kind="stable")
        probs = np.exp(log_softmax(x[order].astype(np.float32)))
        drop = np.cumsum(probs) <= 1 - params.top_p
        drop[-1] = False
        x = x.copy()
        x[order[drop]] = -np.inf
    return x.astype(np.float32)


def target_distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    x = reference_logits(logits, params, np.zeros(0, np.int64), 0, 0)
    return np.exp(log_softmax(x))


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's chi-square p-value; bins expecting < 5 samples are merged, zero-probability bins left out."""
    expected = probs * counts.sum()
    live = probs > 0
    small = live & (expected < 5)
    observed = np.append(counts[live & ~small], counts[small].sum())
    expected = np.append(expected[live & ~small], expected[small].sum())
    if not small.any():
        observed, expected = observed[:-1], expected[:-1]
    stat = np.sum((observed - expected) ** 2 / expected)
    return float(jax.scipy.special.gammaincc((len(observed) - 1) / 2.0, stat / 2.0))


# ---------------------------------------------------------------- helpers


def batch(params_list, positions, config, prompt_lens=None, seeds=None, num_rows=None, variants=()):
    prompt_lens = prompt_lens or [0] * len(params_list)
    seeds = seeds or list(range(len(params_list)))
    requests = [prepare(p, s, n, config) for p, s, n in zip(params_list, seeds, prompt_lens)]
    return metadata(requests, positions, num_rows or len(requests), config, variants)


def repeat_row(md, n: int):
    """A bucket of n copies of row 0, sampling at positions 0..n-1."""
    md = jax.tree.map(lambda a: np.repeat(a[:1], n, axis=0), md)
    return dataclasses.replace(md, positions=np.arange(n, dtype=np.int32))


def no_history(n: int) -> np.ndarray:
    return np.zeros((n, 0), np.int32)


# ---------------------------------------------------------------- statistics

VOCAB = 32
NUM_SAMPLES = 100_000
STAT_LOGITS = np.random.default_rng(7).normal(0.0, 1.5, VOCAB).astype(np.float32)
STAT_CASES = {
    "temperature 1": SamplingParams(temperature=1.0),
    "temperature 0.5": SamplingParams(temperature=0.5),
    "top_k": SamplingParams(temperature=1.5, top_k=5),
    "top_p": SamplingParams(top_p=0.7),
    "min_p": SamplingParams(temperature=1.3, min_p=0.1),
    "top_k + top_p": SamplingParams(temperature=0.8, top_k=12, top_p=0.85),
    "top_k + top_p + min_p": SamplingParams(temperature=1.2, top_k=20, top_p=0.9, min_p=0.03),
    "allowed + bias + top_p": SamplingParams(
        temperature=0.9, allowed_token_ids=[1, 4, 9, 16, 25, 30, 31], logit_bias={4: 1.5, 30: -0.5}, top_p=0.95
    ),
}
STAT_CONFIG = spec(VOCAB, max_logit_bias=4, max_allowed_token_ids=8)
STAT_FLAGS = SamplerFlags(top_k_top_p=True, min_p=True, logit_bias=True, allowed_token_ids=True, count_nans=True)


@pytest.fixture(scope="module")
def stat_counts() -> dict[str, np.ndarray]:
    """Token counts of NUM_SAMPLES draws per case (one compiled graph for all cases)."""
    logits = jnp.broadcast_to(STAT_LOGITS, (NUM_SAMPLES, VOCAB))
    counts = {}
    for seed, (name, params) in enumerate(STAT_CASES.items()):
        md, flags = batch([params], [0], STAT_CONFIG, seeds=[seed], variants=[STAT_FLAGS])
        assert flags == STAT_FLAGS
        tokens = sample_jit(logits, repeat_row(md, NUM_SAMPLES), flags, no_history(NUM_SAMPLES)).tokens
        counts[name] = np.bincount(np.asarray(tokens), minlength=VOCAB)
    return counts


@pytest.mark.parametrize("name", list(STAT_CASES))
def test_samples_follow_the_target_distribution(stat_counts, name):
    probs = target_distribution(STAT_LOGITS, STAT_CASES[name])
    counts = stat_counts[name]
    assert counts.sum() == NUM_SAMPLES
    assert counts[probs == 0].sum() == 0, "a token outside the kept set was sampled"
    assert chi2_pvalue(counts, probs) > 1e-3


def test_only_allowed_tokens_appear(stat_counts):
    counts = stat_counts["allowed + bias + top_p"]
    outside = np.setdiff1d(np.arange(VOCAB), STAT_CASES["allowed + bias + top_p"].allowed_token_ids)
    assert counts[outside].sum() == 0 and (counts > 0).sum() >= 5


def test_chi_square_rejects_wrong_distributions(stat_counts):
    """The test above has power: a slightly wrong temperature, or a missing cut, is rejected."""
    counts = stat_counts["temperature 1"]
    assert chi2_pvalue(counts, target_distribution(STAT_LOGITS, SamplingParams(temperature=1.03))) < 1e-6
    counts = stat_counts["top_k + top_p"]
    wrong = target_distribution(STAT_LOGITS, SamplingParams(temperature=0.8, top_k=12))
    assert chi2_pvalue(counts, wrong) < 1e-6


# ---------------------------------------------------------------- logits processing against the reference

MIXED_VOCAB = 64
MIXED_CONFIG = spec(MIXED_VOCAB, (63,), max_logit_bias=4, max_allowed_token_ids=16, max_stop_token_ids=4,
    max_bad_words=4, max_bad_word_len=3,
)
PROMPT = [5, 9, 9, 12, 40, 3]
OUTPUT = [7, 9, 21, 21, 21, 33, 7, 8]
HISTORY_ROW = np.array(PROMPT + OUTPUT + [0] * 10, np.int32)  # generated tokens follow the prompt; then junk
MIXED = [
    # (params, position of the sampled token)
    (SamplingParams(temperature=0.7, repetition_penalty=1.3), 14),
    (SamplingParams(temperature=1.1, frequency_penalty=0.4, presence_penalty=-0.7), 14),
    (SamplingParams(temperature=0.0, repetition_penalty=0.8, frequency_penalty=-0.3, presence_penalty=1.5), 11),
    (SamplingParams(temperature=0.9, logit_bias={3: 5.0, 60: -2.0, 9: 1.0}, top_k=7), 14),
    (SamplingParams(temperature=1.3, allowed_token_ids=list(range(10, 26)), min_p=0.2), 14),
    (SamplingParams(temperature=0.6, min_tokens=9, stop_token_ids=[1, 2]), 14),  # 8 generated: stops banned
    (SamplingParams(temperature=0.6, min_tokens=8, stop_token_ids=[1, 2]), 14),  # 8 generated: free
    # The output ends with [33, 7, 8]: [7, 8, 4] and [8] match, [33, 7, 9] bans 9 only after [33, 7].
    (SamplingParams(bad_words_token_ids=[[7, 8, 4], [8], [33, 7, 9], [21, 22]]), 14),
    (SamplingParams(temperature=1.0, top_k=3, top_p=0.5, min_p=0.05, repetition_penalty=1.2, logit_bias={0: 3.0}), 14),
    # Nothing generated yet: a bad word's prefix never matches the prompt ([40, 3] ends it).
    (SamplingParams(bad_words_token_ids=[[40, 3, 6], [5]], temperature=0.3), 6),
]


def mixed_inputs(rng, variants=()):
    params = [p for p, _ in MIXED]
    positions = [pos for _, pos in MIXED]
    md, flags = batch(params, positions, MIXED_CONFIG, prompt_lens=[len(PROMPT)] * len(MIXED), num_rows=16,
                      variants=variants)
    logits = rng.normal(0.0, 2.0, (16, MIXED_VOCAB)).astype(np.float32)
    history = np.tile(HISTORY_ROW, (16, 1))
    return logits, md, flags, history


def reference_rows(logits):
    return [
        reference_logits(logits[i], p, HISTORY_ROW, pos, len(PROMPT), MIXED_CONFIG.eos_token_ids)
        for i, (p, pos) in enumerate(MIXED)
    ]


@pytest.mark.parametrize("promoted", [False, True])
def test_processed_logits_match_the_reference(promoted):
    logits, md, flags, history = mixed_inputs(np.random.default_rng(1), covering(MIXED_CONFIG) if promoted else ())
    if promoted:
        assert flags == covering(MIXED_CONFIG)[4]  # everything, no logprobs, no grammar
    got = np.asarray(process_jit(logits, md, flags, history))
    for i, want in enumerate(reference_rows(logits)):
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-6, err_msg=f"row {i}: {MIXED[i][0]}")


def test_bad_words_and_min_tokens_ban_what_they_should():
    logits, md, flags, history = mixed_inputs(np.random.default_rng(2))
    got = np.asarray(process_jit(logits, md, flags, history))
    assert np.isneginf(got[5, [1, 2, 63]]).all() and np.isfinite(got[6, [1, 2, 63]]).all()
    assert np.isneginf(got[7, [4, 8]]).all() and np.isfinite(got[7, [9, 22]]).all()
    assert np.isneginf(got[9, 5]) and np.isfinite(got[9, 6])


def test_greedy_rows_take_the_argmax_of_the_processed_logits():
    logits, md, flags, history = mixed_inputs(np.random.default_rng(3))
    md = dataclasses.replace(md, temperature=np.zeros_like(md.temperature))
    tokens = np.asarray(sample_jit(logits, md, flags, history).tokens)
    for i, (p, pos) in enumerate(MIXED):
        greedy = dataclasses.replace(p, temperature=0.0)
        want = reference_logits(logits[i], greedy, HISTORY_ROW, pos, len(PROMPT), MIXED_CONFIG.eos_token_ids)
        assert tokens[i] == np.argmax(want)


def test_nans_are_counted_and_never_sampled():
    logits, md, flags, history = mixed_inputs(np.random.default_rng(4))
    logits[0, [3, 5, 8]] = np.nan
    logits[9, :] = -50.0
    logits[9, 17] = np.nan
    out = sample_jit(logits, md, flags, history)
    assert np.asarray(out.num_nans)[[0, 1, 9]].tolist() == [3, 0, 1]
    assert int(out.tokens[0]) not in (3, 5, 8) and int(out.tokens[9]) != 17


# ---------------------------------------------------------------- logprobs


def test_compute_logprobs_matches_log_softmax_and_ranks():
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(6, 50)).astype(np.float32)
    logits[2, [4, 9]] = logits[2, 30]  # ties: the rank counts every logit >= the target's
    targets = np.array([0, 7, 30, 49, 13, 2], np.int32)
    values, ids, ranks = jax.jit(compute_logprobs, static_argnums=(2, 3))(logits, targets, 5)
    ids = np.asarray(ids)
    want = log_softmax(logits)
    assert (ids[:, 0] == targets).all()
    np.testing.assert_array_equal(ids[:, 1:], np.argsort(-logits, axis=1, kind="stable")[:, :5])
    np.testing.assert_allclose(np.asarray(values), np.take_along_axis(want, ids, axis=1), rtol=1e-5, atol=1e-5)
    want_ranks = (logits >= logits[np.arange(6), targets][:, None]).sum(axis=1)
    np.testing.assert_array_equal(np.asarray(ranks), want_ranks)
    raw, _, _ = jax.jit(compute_logprobs, static_argnums=(2, 3))(logits, targets, 5, True)
    np.testing.assert_array_equal(np.asarray(raw), np.take_along_axis(logits, ids, axis=1))


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"])
def test_sampled_logprobs_follow_the_mode(mode):
    config = MIXED_CONFIG.replace(logprobs_mode=mode, max_logprobs=4)
    params = [dataclasses.replace(p, logprobs=2) for p, _ in MIXED]
    md, flags = batch(params, [pos for _, pos in MIXED], config, prompt_lens=[len(PROMPT)] * len(MIXED), num_rows=16)
    assert flags.num_logprobs == 4 and flags.logprobs_mode == mode
    logits = np.random.default_rng(6).normal(0.0, 2.0, (16, MIXED_VOCAB)).astype(np.float32)
    history = np.tile(HISTORY_ROW, (16, 1))
    out = sample_jit(logits, md, flags, history)
    source = np.asarray(process_jit(logits, md, flags, history)) if "processed" in mode else logits
    values = source if mode.endswith("logits") else log_softmax(source)
    tokens, ids = np.asarray(out.tokens), np.asarray(out.logprob_token_ids)
    assert ids.shape == (16, 5) and (ids[:, 0] == tokens).all()
    np.testing.assert_allclose(np.asarray(out.logprobs), np.take_along_axis(values, ids, axis=1), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.ranks), (source >= source[np.arange(16), tokens][:, None]).sum(axis=1))


def test_no_logprobs_means_empty_columns():
    logits, md, flags, history = mixed_inputs(np.random.default_rng(7))
    out = sample_jit(logits, md, dataclasses.replace(flags, num_logprobs=-1), history)
    assert out.logprobs.shape == (16, 0) and out.logprob_token_ids.shape == (16, 0)


# ---------------------------------------------------------------- seeds


def test_a_seeded_request_samples_the_same_tokens_in_any_batch():
    """Same seed and position: same token, whatever the other rows, the bucket or the graph variant."""
    vocab = 300
    config = spec(vocab, max_logit_bias=4, max_allowed_token_ids=4, max_stop_token_ids=4,
                           max_bad_words=2, max_bad_word_len=2)
    mine = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, seed=2**63 + 12345)
    others = [
        SamplingParams(temperature=1.4, repetition_penalty=1.5, logprobs=3, bad_words_token_ids=[[5, 6]]),
        SamplingParams(temperature=0.0, logit_bias={1: 2.0}, min_tokens=3, stop_token_ids=[2]),
        SamplingParams(temperature=0.5, allowed_token_ids=[1, 2, 3]),
    ]
    rng = np.random.default_rng(8)
    mixes = [  # (rows before mine, rows after, bucket, variants)
        ([], [], 1, ()),
        (others[:1], others[1:], 8, ()),
        (others[2:], [], 4, covering(config)),
        (others, others, 16, covering(config)),
    ]
    tokens = np.zeros((len(mixes), 24), np.int32)
    for step, position in enumerate(range(20, 44)):
        row_logits = rng.normal(0.0, 3.0, vocab).astype(np.float32)
        for m, (before, after, bucket, variants) in enumerate(mixes):
            params = before + [mine] + after
            seeds = [p.seed if p.seed is not None else 99 + i for i, p in enumerate(params)]
            md, flags = batch(params, [position] * len(params), config, prompt_lens=[10] * len(params), seeds=seeds,
                              num_rows=bucket, variants=variants)
            logits = rng.normal(0.0, 3.0, (bucket, vocab)).astype(np.float32)
            logits[len(before)] = row_logits
            history = rng.integers(0, vocab, (bucket, 64)).astype(np.int32)
            tokens[m, step] = sample_jit(logits, md, flags, history).tokens[len(before)]
    assert (tokens == tokens[0]).all()
    assert len(set(tokens[0].tolist())) > 10  # it does sample


def test_seeds_and_positions_change_the_noise():
    config = spec(1000)
    logits = np.zeros((4, 1000), np.float32)
    md, flags = batch([SamplingParams()] * 4, [5, 6, 5, 5], config, seeds=[1, 1, 2, 2**32 + 1])
    tokens = np.asarray(sample_jit(logits, md, flags, no_history(4)).tokens)
    assert len(set(tokens.tolist())) == 4


# ---------------------------------------------------------------- prompt logprobs


def fake_prompt_logits(tokens: np.ndarray, vocab: int) -> np.ndarray:
    """Logits at every position of a toy causal model: a function of the token and the one before."""
    table = np.random.default_rng(9).normal(size=(2, vocab, vocab)).astype(np.float32)
    previous = np.concatenate([[0], tokens[:-1]])
    return table[0][tokens] + 0.5 * table[1][previous]


def prompt_logprobs_in_chunks(prompt: np.ndarray, chunks: list[int], vocab: int, num_top: int):
    """What the runner does: compute each chunk's rows, buffer them, emit once the prompt is done."""
    logits = fake_prompt_logits(prompt, vocab)
    buffer, emitted, done = PromptLogprobsBuffer(), [], 0
    for size in chunks:
        rows = np.array(prompt_logprob_positions(len(prompt), len(prompt), done, size), np.int64)
        padded = np.zeros(16, np.int64)  # a fixed bucket of rows, as a runner would compile
        padded[: len(rows)] = rows
        values, ids, ranks = jax.jit(compute_logprobs, static_argnums=(2,))(
            logits[padded], prompt[np.minimum(padded + 1, len(prompt) - 1)], num_top
        )
        part = LogprobsArrays(np.asarray(ids), np.asarray(values), np.asarray(ranks))
        part = part.select(slice(0, len(rows)), num_top)
        done += size
        result = buffer.add("req", part, prompt_done=done >= len(prompt))
        emitted.append(result)
    return emitted


def test_prompt_logprobs_are_the_same_with_chunked_prefill():
    vocab, prompt = 40, np.random.default_rng(10).integers(0, 40, 14)
    whole = prompt_logprobs_in_chunks(prompt, [14], vocab, 3)
    chunked = prompt_logprobs_in_chunks(prompt, [4, 5, 4, 1], vocab, 3)  # the last chunk scores nothing
    assert all(e is None for e in chunked[:-1]), "emitted before the prompt was complete"
    want, got = whole[0], chunked[-1]
    assert got.ranks.shape == (13,) and got.token_ids.shape == (13, 4)
    np.testing.assert_array_equal(got.token_ids, want.token_ids)
    np.testing.assert_array_equal(got.ranks, want.ranks)
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-6)
    np.testing.assert_array_equal(got.token_ids[:, 0], prompt[1:])
    reference = log_softmax(fake_prompt_logits(prompt, vocab))[np.arange(13), prompt[1:]]
    np.testing.assert_allclose(got.logprobs[:, 0], reference, rtol=1e-5)


def test_prompt_logprob_positions():
    assert prompt_logprob_positions(10, 10, 0, 4) == range(0, 4)
    assert prompt_logprob_positions(10, 10, 8, 2) == range(8, 9)  # position 9 predicts the first output
    assert prompt_logprob_positions(10, 10, 9, 1) == range(9, 9)
    assert prompt_logprob_positions(10, 13, 0, 13) == range(0)  # resumed after preemption: already sent


def test_prompt_logprobs_buffer_forgets_a_preempted_prompt():
    part = LogprobsArrays(np.zeros((2, 1), np.int32), np.zeros((2, 1), np.float32), np.ones(2, np.int32))
    buffer = PromptLogprobsBuffer()
    assert buffer.add("a", part, prompt_done=False) is None
    buffer.discard("a")
    assert buffer.add("a", part, prompt_done=True).ranks.shape == (2,)


# ---------------------------------------------------------------- host side: flags, variants, packing


def test_flags_follow_the_rows_and_variants_cover_them():
    config = spec(100)
    md, flags = batch([SamplingParams(), SamplingParams(temperature=0)], [3, 3], config, num_rows=4)
    assert flags == SamplerFlags(count_nans=True)
    assert md.bias_token_ids.shape == (4, 0) and md.bad_words.shape == (4, 0, 0)
    assert md.temperature.tolist() == [1.0, 0.0, 0.0, 0.0] and md.top_k.tolist() == [100] * 4
    _, flags = batch([SamplingParams(top_p=0.5), SamplingParams(presence_penalty=0.1)], [3, 3], config)
    assert flags.top_k_top_p and flags.penalties and not flags.min_p
    _, flags = batch([SamplingParams(min_tokens=2)], [3], config, prompt_lens=[2])  # no stop ids, no EOS
    assert not flags.min_tokens
    config = dataclasses.replace(config, eos_token_ids=(7,))
    _, flags = batch([SamplingParams(min_tokens=2)], [3], config, prompt_lens=[2])
    assert flags.min_tokens
    _, flags = batch([SamplingParams(min_tokens=2)], [4], config, prompt_lens=[2])
    assert not flags.min_tokens  # two tokens generated: nothing to ban any more
    variants = covering(config)
    assert len(variants) == 12 and all(variants[-2].covers(v) for v in variants if v.num_logprobs == -1)
    assert not any(v.grammar for v in variants[:6]) and all(v.grammar for v in variants[6:])
    md, flags = batch([SamplingParams(top_k=3, logprobs=1)], [3], config, variants=variants)
    assert flags == variants[3] and md.bias_token_ids.shape == (1, 0)
    md, flags = batch([SamplingParams(logit_bias={1: 1.0})], [3], config, variants=variants)
    assert flags == variants[4] and md.bias_token_ids.shape == (1, config.max_logit_bias)


def test_prepare_request_packs_and_checks_limits():
    config = spec(50, (49,), max_logit_bias=2, max_bad_word_len=3)
    packed = prepare(
        SamplingParams(top_k=80, min_tokens=1, stop_token_ids=[3], bad_words_token_ids=[[1, 2], [4]], logprobs=-1),
        2**64 - 1, 5, config.replace(max_logprobs=-1),
    )
    assert packed.top_k == 50 and packed.min_len == 6 and packed.num_logprobs == 50
    assert packed.stop_token_ids.tolist() == [3, 49]
    assert packed.bad_words.tolist() == [[-1, 1, 2], [-1, -1, 4]]
    md, _ = metadata([packed], [5], 2, config)
    assert md.seeds.tolist() == [[2**32 - 1, 2**32 - 1], [0, 0]]
    with pytest.raises(ValueError, match="logit_bias entries"):
        prepare(SamplingParams(logit_bias={1: 1.0, 2: 1.0, 3: 1.0}), 0, 1, config)
    with pytest.raises(ValueError, match="tokens in one bad word"):
        prepare(SamplingParams(bad_words_token_ids=[[1, 2, 3, 4]]), 0, 1, config)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        prepare(SamplingParams(allowed_token_ids=[50]), 0, 1, config)
    with pytest.raises(ValueError, match="maximum"):
        prepare(SamplingParams(logprobs=21), 0, 1, config)


def test_neutral_metadata_matches_the_flags():
    config = spec(10, max_logit_bias=2, max_allowed_token_ids=2, max_stop_token_ids=2,
                           max_bad_words=3, max_bad_word_len=2)
    md = neutral(4, config, covering(config)[-1])
    assert md.allowed_token_ids.shape == (4, config.max_allowed_token_ids) and md.bad_words.shape == (4, 3, 2)
    tokens = sample_jit(np.zeros((4, 10), np.float32), md, covering(config)[-1], np.zeros((4, 3), np.int32))
    assert tokens.tokens.tolist() == [0, 0, 0, 0]


def test_ordered_keys_sort_like_floats():
    x = np.array([np.inf, 2.5, 1e-30, 0.0, -0.0, -1e-30, -3.0, -np.inf, 7e37], np.float32)
    keys = np.asarray(ordered_keys(jnp.asarray(x)))
    order = np.argsort(keys, kind="stable")
    assert np.all(np.diff(x[order]) >= 0) and keys[3] == keys[4]


def test_top_ids_match_a_stable_argsort_and_stay_distinct():
    x = np.random.default_rng(11).normal(size=(4, 300)).astype(np.float32)
    x[1, [3, 7, 200]] = 9.0  # ties: lowest id first
    x[2, 5:] = -np.inf  # fewer finite values than asked for
    for n in (0, 3, 16, 20, 37):
        ids = np.asarray(jax.jit(top_ids, static_argnums=1)(x, n))
        np.testing.assert_array_equal(ids, np.argsort(-x, axis=1, kind="stable")[:, :n])
        assert all(len(set(row)) == n for row in ids)


# ---------------------------------------------------------------- the Pallas tally kernel


def kernel_inputs(rng, batch: int, vocab: int):
    """Random logits (some masked), and candidates as the search makes them: above the row's minimum."""
    x = rng.normal(0.0, 3.0, (batch, vocab)).astype(np.float32)
    x[rng.random((batch, vocab)) < 0.1] = -np.inf
    keys = np.asarray(ordered_keys(jnp.asarray(x)))
    low = keys.min(axis=1, keepdims=True)
    cand = np.sort(rng.choice(keys[keys > low.min()], (batch, NUM_CANDIDATES)), axis=1)
    cand = np.maximum(cand, low + 1).astype(np.int32)
    floor = keys[np.arange(batch), rng.integers(0, vocab, batch)]
    return x, cand, floor, np.max(x, axis=1)


@pytest.mark.parametrize("mass", [False, True])
def test_tally_kernel_matches_its_reference(mass):
    rng = np.random.default_rng(12)
    x, cand, floor, row_max = kernel_inputs(rng, 3, 3000)
    padded = np.pad(x, ((0, 0), (0, padded_vocab(3000) - 3000)), constant_values=-np.inf)
    got = jax.jit(tally_kernel, static_argnums=(4, 5))(padded, cand, floor, row_max, mass, True)
    want = jax.jit(tally_reference, static_argnums=4)(x, cand, floor, row_max, mass)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)


def test_truncation_with_the_kernel_matches_the_reference():
    rng = np.random.default_rng(13)
    x = rng.normal(0.0, 2.0, (4, 500)).astype(np.float32)
    top_k = np.array([500, 7, 60, 1], np.int32)
    top_p = np.array([0.9, 1.0, 0.7, 0.5], np.float32)
    got = np.asarray(jax.jit(top_k_top_p, static_argnums=3)(x, top_k, top_p, PALLAS))
    for i in range(4):
        params = SamplingParams(temperature=1.0, top_k=int(top_k[i]), top_p=float(top_p[i]))
        want = reference_logits(x[i], params, np.zeros(0, np.int64), 0, 0)
        np.testing.assert_array_equal(got[i], want)


@pytest.mark.gpu
def test_truncation_on_gpu_at_full_size():
    rng = np.random.default_rng(14)
    x = rng.normal(0.0, 2.0, (64, 128256)).astype(np.float32)
    x[np.arange(64)[:, None], rng.integers(0, 128256, (64, 8))] += rng.uniform(4, 12, (64, 8))
    top_k = rng.choice([128256, 20, 50, 1000], 64).astype(np.int32)
    top_p = rng.choice([1.0, 0.8, 0.95], 64).astype(np.float32)
    got = np.asarray(jax.jit(top_k_top_p, static_argnums=3)(x, top_k, top_p, PALLAS))
    for i in range(64):
        params = SamplingParams(top_k=int(top_k[i]) if top_k[i] < 128256 else -1, top_p=float(top_p[i]))
        np.testing.assert_array_equal(got[i], reference_logits(x[i], params, np.zeros(0, np.int64), 0, 0))
