"""Speculative decoding: drafts change how many tokens a step keeps, never which tokens.

n-gram drafts are verified against plain sampling's own noise, so every output (greedy or seeded,
with penalties, min_tokens, stop strings, logprobs, n > 1) equals the output without drafts; a
draft model's greedy outputs do too, and its sampled ones have plain sampling's distribution
(checked on the rejection sampler itself, with a chi-square test).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats
from test_async_multistep import ENGINE, PARAMS, PROMPTS, assert_same

from jaxrunner import LLM, NewRequestData, Runner, RunnerConfig, SamplingParams, SchedulerOutput
from jaxrunner.config import Kernels, SamplerConfig, SpeculativeConfig
from jaxrunner.engine.default_model import default_model
from jaxrunner.sampling import build_sampling_metadata, prepare_request, process_logits
from jaxrunner.spec_decode.ngram import ngram_drafts
from jaxrunner.spec_decode.rejection import verify_drafts
from jaxrunner.step_io import CachedRequestData

MODELS = Path(__file__).parent / "data" / "models"
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


def generate(prompts=PROMPTS, params=PARAMS, engine=ENGINE, **kwargs) -> tuple[tuple, dict, LLM]:
    """(what `assert_same` compares, the engine's speculative-decoding counters, the LLM)."""
    llm = LLM(**engine, **kwargs)
    outs = llm.generate(prompts, params, use_tqdm=False)
    completions = [c for o in outs for c in o.outputs]
    exact = [(c.token_ids, c.text, c.finish_reason, c.stop_reason,
              c.logprobs and [sorted((t, lp.rank) for t, lp in d.items()) for d in c.logprobs]) for c in completions]
    values = [c.logprobs and [[d[t].logprob for t in sorted(d)] for d in c.logprobs] for c in completions]
    return (exact, values), llm.llm_engine.stats().spec_decoding, llm


@pytest.fixture(scope="module")
def reference():
    return generate(async_scheduling=False)[0]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_ngram_outputs_equal_plain_sampling(reference, async_scheduling):
    got, spec, llm = generate(async_scheduling=async_scheduling, speculative_config=NGRAM)
    assert_same(got, reference)
    assert spec["num_accepted_tokens"] > 0 and spec["num_draft_tokens"] > spec["num_accepted_tokens"]


def test_ngram_outputs_equal_plain_sampling_with_prefix_cache_hits():
    """The second round of prompts finds the first round's blocks (its KV, and with a draft model its
    draft KV too, computed alongside)."""
    shared = "A shared system prompt that fills blocks. "
    prompts = [shared + p for p in PROMPTS]
    outputs = {}
    for spec in (None, NGRAM):
        llm = LLM(**ENGINE, speculative_config=spec, num_gpu_blocks_override=64)
        outputs[spec is None] = [generate_with(llm, prompts) for _ in range(2)]
        assert llm.llm_engine.stats().prefix_cache_hits > 0
    assert outputs[True] == outputs[False] and all(outputs[True][0])


def generate_with(llm: LLM, prompts: list[str]) -> list[list[int]]:
    return [c.token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False) for c in o.outputs]


def test_ngram_outputs_equal_plain_sampling_under_preemption(reference):
    got, spec, llm = generate(speculative_config=NGRAM, num_gpu_blocks_override=12, block_size=8)
    assert llm.llm_engine.scheduler.num_preemptions > 0 and spec["num_accepted_tokens"] > 0
    assert_same(got, reference)


def test_ngram_accepts_a_repeated_continuation():
    """Output that repeats itself (a logit bias makes it): the lookup proposes the repeat, and it is accepted."""
    token = LLM(**ENGINE).get_tokenizer().encode("a")[0]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, logprobs=1, logit_bias={token: 30.0})
    plain, _, _ = generate(["a b a b a b a b"], params)
    got, spec, _ = generate(["a b a b a b a b"], params, speculative_config={**NGRAM, "num_speculative_tokens": 4})
    assert_same(got, plain)
    assert spec["acceptance_rate"] > 0.5 and spec["mean_acceptance_length"] > 2


TOKEN_ENGINE = {"model": str(MODELS / "tiny-llama"), "skip_tokenizer_init": True, "max_num_seqs": 4,
                "max_num_batched_tokens": 16, "max_model_len": 96, "num_gpu_blocks_override": 64}
RNG = np.random.default_rng(0)
TOKEN_PROMPTS = [{"prompt_token_ids": RNG.integers(0, 512, n).tolist()} for n in (5, 17, 40, 9)]
GREEDY = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=lp) for m, lp in
          ((30, None), (25, 2), (20, None), (28, None))]


@pytest.mark.parametrize("draft, preempt", [("tiny-llama", False), ("tiny-llama", True), ("tiny-mistral", False)])
def test_draft_model_greedy_outputs_equal_plain_decoding(draft, preempt):
    """Chunked prefill (16-token budget, a 40-token prompt); with `preempt`, too few blocks. The
    target as its own draft is always right; another model rarely is."""
    blocks = {"num_gpu_blocks_override": 14, "block_size": 8} if preempt else {}
    engine = {**TOKEN_ENGINE, **blocks}
    plain, _, _ = generate(TOKEN_PROMPTS, GREEDY, engine)
    config = {"method": "draft_model", "model": str(MODELS / draft), "num_speculative_tokens": 3}
    got, spec, llm = generate(TOKEN_PROMPTS, GREEDY, engine, speculative_config=config)
    assert_same(got, plain)
    assert (llm.llm_engine.scheduler.num_preemptions > 0) == preempt
    if draft == "tiny-llama":
        assert spec["acceptance_rate"] == 1.0 and spec["num_draft_tokens"] > 20
    else:
        assert 0 < spec["num_draft_tokens"] and spec["acceptance_rate"] < 0.5


def _verify_batch(logits: np.ndarray, params: SamplingParams, draft_probs: np.ndarray | None, drafts: np.ndarray):
    """verify_drafts over N requests with one draft each; every request shares the logits [2, V] and
    has its own seed. Returns (tokens [N, 2], num_kept [N], p_0: what plain sampling draws from)."""
    n, vocab = drafts.shape[0], logits.shape[1]
    config = SamplerConfig()
    requests = [dataclasses.replace(prepare_request(params, 0, 4, config, vocab), seed=1000 + i) for i in range(n)]
    md, flags = build_sampling_metadata(requests, [4] * n, n, config, vocab)
    md = jax.tree.map(lambda x: jnp.repeat(jnp.asarray(x), 2, axis=0), md)
    md = dataclasses.replace(md, positions=jnp.tile(jnp.array([4, 5], jnp.int32), n))
    rows = jnp.tile(jnp.asarray(logits), (n, 1))
    processed = process_logits(rows, md, flags, jnp.zeros((2 * n, 0), jnp.int32), Kernels.choose("reference"))
    probs = None if draft_probs is None else jnp.asarray(draft_probs)
    tokens, kept = jax.jit(verify_drafts)(processed, md, jnp.asarray(drafts), jnp.ones(n, jnp.int32), probs)
    p0 = jax.nn.softmax(processed[0])
    return np.asarray(tokens), np.asarray(kept), np.asarray(p0)


@pytest.mark.parametrize("with_q", [True, False])
def test_rejection_sampler_keeps_plain_samplings_distribution(with_q):
    """Drafts drawn from a q unlike p (or point masses, with_q False): the first kept token follows
    p after temperature, top-k and top-p; the drafts are accepted at the rate min(1, p / q) gives."""
    vocab, n = 12, 40000
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 1.5, (2, vocab)).astype(np.float32)
    params = SamplingParams(temperature=0.8, top_k=9, top_p=0.95)
    q = rng.dirichlet(np.ones(vocab)).astype(np.float32)
    drafts = rng.choice(vocab, size=n, p=q / q.sum()).astype(np.int32)[:, None]
    probs = np.broadcast_to(q, (n, 1, vocab)).copy() if with_q else None
    tokens, kept, p0 = _verify_batch(logits, params, probs, drafts)
    counts = np.bincount(tokens[:, 0], minlength=vocab)
    support = p0 > 0
    assert counts[~support].sum() == 0  # nothing outside top-k / top-p
    p_support = p0[support].astype(np.float64)
    expected_counts = p_support / p_support.sum() * counts.sum()
    assert stats.chisquare(counts[support], expected_counts).pvalue > 1e-3
    accepted = np.mean(kept == 2)
    expected = np.sum(np.minimum(p0, q)) if with_q else np.sum(p0 * q)  # point masses: P(accept d) = p(d)
    assert abs(accepted - expected) < 0.01
    assert np.all(tokens[kept == 2, 0] == drafts[kept == 2, 0])


def test_rejection_sampler_greedy_rows_accept_exactly_the_argmax():
    vocab, n = 12, 64
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 1.0, (2, vocab)).astype(np.float32)
    drafts = rng.integers(0, vocab, (n, 1)).astype(np.int32)
    q = rng.dirichlet(np.ones(vocab), size=(n, 1)).astype(np.float32)
    for probs in (q, None):
        tokens, kept, _ = _verify_batch(logits, SamplingParams(temperature=0.0), probs, drafts)
        best = int(np.argmax(logits[0]))
        assert np.all((kept == 2) == (drafts[:, 0] == best)) and np.all(tokens[:, 0] == best)
        assert np.all(tokens[kept == 2, 1] == int(np.argmax(logits[1])))


def _ngram_reference(row: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    for n in range(n_max, n_min - 1, -1):
        if len(row) <= n:
            continue
        suffix = row[-n:]
        for end in range(len(row) - 2, n - 2, -1):  # the latest earlier occurrence
            if row[end - n + 1 : end + 1] == suffix:
                return [row[min(end + 1 + i, len(row) - 1)] for i in range(k)]
    return [row[-1]] * k


def test_ngram_drafts_match_a_plain_python_lookup():
    rng = np.random.default_rng(3)
    rows, lens = np.zeros((64, 48), np.int32), rng.integers(1, 48, 64)
    for i in range(64):
        rows[i] = rng.integers(0, 4 if i % 2 else 50, 48)  # small alphabets repeat, large ones rarely
    got = np.asarray(jax.jit(ngram_drafts, static_argnums=(2, 3, 4))(jnp.asarray(rows), jnp.asarray(lens), 3, 2, 4))
    want = [_ngram_reference(rows[i, : lens[i]].tolist(), 3, 2, 4) for i in range(64)]
    assert got.tolist() == want
    assert sum(w != [r[lens[i] - 1]] * 3 for i, (w, r) in enumerate(zip(want, rows))) > 10  # matches were found


def _runner(k: int = 2) -> tuple[Runner, object]:
    """A runner with speculative decoding whose request "a" has prefilled 5 tokens and sampled one."""
    cfg, params = default_model()
    config = RunnerConfig(max_num_seqs=2, max_model_len=64, block_size=4, num_blocks=32,
                          speculative=SpeculativeConfig(num_speculative_tokens=k))
    runner = Runner(cfg, params, config)
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    new = NewRequestData("a", [5, 6, 7, 5, 6], ([0, 1],), sampling_params=greedy)
    state, out = runner.step(runner.init_state(), SchedulerOutput([new], num_scheduled_tokens={"a": 5},
                                                                  total_num_scheduled_tokens=5))
    assert len(out.sampled_token_ids[0]) == 1
    return runner, state


def _decode(drafts: list[int], computed: int = 5, blocks=None, n: int | None = None) -> SchedulerOutput:
    n = 1 + len(drafts) if n is None else n
    return SchedulerOutput(scheduled_cached_reqs=CachedRequestData(["a"], [blocks], [computed]),
                           num_scheduled_tokens={"a": n}, total_num_scheduled_tokens=n,
                           scheduled_spec_decode_tokens={"a": drafts} if drafts is not None else {})


def test_runner_takes_host_drafts_and_keeps_the_accepted_prefix():
    """Drafts given by the caller: the greedy continuation is accepted whole (plus a bonus token),
    a wrong draft cuts the step after the correction."""
    runner, state = _runner()
    plain, plain_state = _runner()  # decodes without drafts: one token a step
    tokens = []
    for i in range(4):  # the plain continuation, one token per step
        plain_state, out = plain.step(plain_state, _decode([], computed=5 + i, blocks=([2, 3],) if i == 0 else None))
        tokens += out.sampled_token_ids[0]
    state, out = runner.step(state, _decode(tokens[:2], blocks=([2, 3],)))
    assert out.sampled_token_ids[0] == tokens[:3]
    wrong = (tokens[3] + 1) % runner.model_config.vocab_size
    state, out = runner.step(state, _decode([tokens[3], wrong], computed=8))
    assert out.sampled_token_ids[0][:1] == [tokens[3]] and len(out.sampled_token_ids[0]) == 2


@pytest.mark.parametrize("sched, message", [
    (_decode([1, 2, 3], blocks=([2, 3],)), "3 draft tokens exceed num_speculative_tokens=2"),
    (_decode([1], blocks=([2, 3],), n=3), "a decode with 1 drafts schedules 2 tokens, not 3"),
    (_decode([10**6], blocks=([2, 3],)), "outside the vocabulary"),
    (_decode([1, 2], computed=6, blocks=None), "2 blocks cannot hold 9 tokens"),
])
def test_runner_rejects_bad_drafts_and_keeps_its_state(sched, message):
    runner, state = _runner()
    with pytest.raises(ValueError, match=message):
        runner.step(state, sched)
    state, out = runner.step(state, _decode([-1, -1], blocks=([2, 3],)))  # the device's drafts: the runner is intact
    assert 1 <= len(out.sampled_token_ids[0]) <= 3


def test_draft_tokens_are_checked_when_the_schedule_is_made():
    with pytest.raises(ValueError, match="must be a list of integers"):
        _decode([1.5], blocks=([2, 3],))


def test_drafts_need_speculative_decoding_and_a_decode():
    cfg, params = default_model()
    plain = Runner(cfg, params, RunnerConfig(max_num_seqs=2, max_model_len=64, block_size=4, num_blocks=32))
    new = NewRequestData("a", [5, 6, 7], ([0],), sampling_params=SamplingParams(temperature=0.0))
    sched = SchedulerOutput([new], num_scheduled_tokens={"a": 3}, total_num_scheduled_tokens=3,
                            scheduled_spec_decode_tokens={"a": [1, 2]})
    with pytest.raises(ValueError, match="speculative decoding is off"):
        plain.step(plain.init_state(), sched)
    spec = Runner(cfg, params, dataclasses.replace(plain.config, speculative=SpeculativeConfig(num_speculative_tokens=2)))
    with pytest.raises(ValueError, match="has no sampled token yet"):
        spec.step(spec.init_state(), sched)


@pytest.mark.parametrize("config, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}, "exceeds prompt_lookup_max"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs model=DIR"),
    ({"num_speculative_tokens": 2, "lookahead": 1}, "unsupported keys"),
])
def test_bad_speculative_configs_are_named(config, message):
    with pytest.raises(ValueError, match=message):
        LLM(**ENGINE, speculative_config=config)


def test_a_draft_model_with_another_vocabulary_is_refused(tmp_path):
    with pytest.raises(ValueError, match="must share the target's vocabulary"):
        LLM(**ENGINE, speculative_config={"method": "draft_model", "model": str(MODELS / "tiny-llama"),
                                          "num_speculative_tokens": 2})


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_nothing_compiles_after_warm_up_with_speculative_decoding(method):
    """Through preemption and every sampler variant. Contexts of their own (9 blocks): runners of
    one context share their programs and counters. Two request buckets keep the warm-up short."""
    if method == "ngram":
        engine, prompts, params, config = ENGINE, PROMPTS, PARAMS, NGRAM
    else:
        engine, prompts, params = TOKEN_ENGINE, TOKEN_PROMPTS, [dataclasses.replace(p, temperature=0.9, seed=1) for p in PARAMS]
        config = {"method": "draft_model", "model": str(MODELS / "tiny-llama"), "num_speculative_tokens": 2}
    llm = LLM(**{**engine, "num_gpu_blocks_override": 9, "block_size": 8, "max_num_seqs": 2, "max_model_len": 64},
              enforce_eager=False, speculative_config=config)
    programs = llm.llm_engine.runner.programs
    outs = llm.generate(prompts, [dataclasses.replace(p, stop=None) for p in params], use_tqdm=False)
    assert all(o.error is None for o in outs) and llm.llm_engine.stats().spec_decoding["num_accepted_tokens"] > 0
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert programs.asked <= programs.warm and programs.compiled_on_use == 0
    assert any(key[0] == "spec_sample" for key in programs.asked) and not any(key[0] == "sample" for key in programs.asked)


def test_speculative_decoding_and_multi_step_do_not_combine():
    with pytest.raises(ValueError, match="do not combine"):
        LLM(**ENGINE, speculative_config=NGRAM, num_scheduler_steps=4)
