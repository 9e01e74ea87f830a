"""Logprobs and prompt logprobs through LLM.generate, in vLLM's form, on the real Runner (CPU, the
built-in tiny model): checked against the model's logits recomputed directly, and kept the same
across chunked prefill, prefix caching, preemption, streaming, n > 1 and stop conditions."""

from __future__ import annotations

import numpy as np
import pytest
from driver import prompt_logits

from jaxrunner.engine import LLM, Logprob
from jaxrunner.engine.default_model import TINY_MODEL
from jaxrunner.sampling_params import SamplingParams

ENGINE = {"model": TINY_MODEL, "max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 128}
PROMPT = "A prompt long enough to fill a few KV blocks of sixteen tokens."  # 64 tokens with BOS
SCORED = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=2)


@pytest.fixture(scope="module")
def llm():
    return LLM(**ENGINE)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))


def reference(llm: LLM, token_ids: list[int]) -> np.ndarray:
    """Log-softmax of the model's logits at every position of `token_ids`, from a direct forward pass."""
    runner = llm.llm_engine.runner
    return log_softmax(prompt_logits(runner.model_config, runner.params, token_ids, chunk=len(token_ids)))


def chosen(entries: list[dict[int, Logprob] | None], token_ids: list[int]) -> np.ndarray:
    """The logprob of each actual token (a prompt's first token, which has none, is skipped)."""
    return np.array([e[t].logprob for e, t in zip(entries, token_ids) if e is not None])


def test_no_logprobs_unless_asked(llm):
    (out,) = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    c = out.outputs[0]
    assert c.logprobs is None and c.cumulative_logprob is None and out.prompt_logprobs is None


def test_logprobs_match_the_model_recomputed(llm):
    (out,) = llm.generate(PROMPT, SCORED, use_tqdm=False)
    c, prompt, tok = out.outputs[0], out.prompt_token_ids, llm.get_tokenizer()
    ref = reference(llm, prompt + c.token_ids)
    assert len(c.logprobs) == len(c.token_ids) == 8
    for k, (token, entries) in enumerate(zip(c.token_ids, c.logprobs)):
        row = ref[len(prompt) - 1 + k]
        assert entries[token].rank == 1 and entries[token].logprob == max(e.logprob for e in entries.values())
        assert list(entries) == np.argsort(-row, kind="stable")[:3].tolist()  # greedy: the token is the top one
        assert [e.rank for e in entries.values()] == [1, 2, 3]
        np.testing.assert_allclose([e.logprob for e in entries.values()], row[list(entries)], atol=1e-4)
        assert all(e.decoded_token == tok.decode([t]) for t, e in entries.items())
    assert c.cumulative_logprob == pytest.approx(chosen(c.logprobs, c.token_ids).sum())

    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    targets = np.array(prompt[1:])
    np.testing.assert_allclose(chosen(out.prompt_logprobs, prompt), ref[np.arange(len(targets)), targets], atol=1e-4)
    ranks = (ref[: len(targets)] >= ref[np.arange(len(targets)), targets][:, None] - 1e-9).sum(1)
    assert [e[t].rank for e, t in zip(out.prompt_logprobs[1:], prompt[1:])] == ranks.tolist()
    assert all(len(e) in (2, 3) for e in out.prompt_logprobs[1:])  # the prompt token, plus the top 2


def test_prompt_logprobs_do_not_use_prefix_cache_hits(llm):
    (first,) = llm.generate(PROMPT, SCORED, use_tqdm=False)
    (second,) = llm.generate(PROMPT + " More.", SCORED, use_tqdm=False)
    assert second.num_cached_tokens == 0
    prompt = first.prompt_token_ids
    assert second.prompt_token_ids[: len(prompt)] == prompt
    np.testing.assert_allclose(chosen(second.prompt_logprobs, prompt), chosen(first.prompt_logprobs, prompt), atol=1e-4)
    (plain,) = llm.generate(PROMPT + " More.", SamplingParams(max_tokens=1), use_tqdm=False)
    assert plain.num_cached_tokens == len(prompt) // 16 * 16  # the scored requests filled the cache


def test_chunked_prefill_gives_the_same_logprobs(llm):
    (whole,) = llm.generate(PROMPT, SCORED, use_tqdm=False)
    (chunked,) = LLM(**{**ENGINE, "max_num_batched_tokens": 16}).generate(PROMPT, SCORED, use_tqdm=False)
    prompt, c = whole.prompt_token_ids, whole.outputs[0]
    assert chunked.outputs[0].token_ids == c.token_ids
    np.testing.assert_allclose(chosen(chunked.prompt_logprobs, prompt), chosen(whole.prompt_logprobs, prompt), atol=1e-4)
    np.testing.assert_allclose(chosen(chunked.outputs[0].logprobs, c.token_ids), chosen(c.logprobs, c.token_ids), atol=1e-4)


def test_preempted_requests_keep_their_logprobs(llm):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    prompts = [f"Request {i}: tell me a story." for i in range(4)]  # 4 x (29 + 24) tokens > 8 blocks of 16
    roomy = llm.generate(prompts, params, use_tqdm=False)
    small = LLM(num_gpu_blocks_override=8, **ENGINE)
    tight = small.generate(prompts, params, use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    for a, b in zip(tight, roomy):
        ids = a.outputs[0].token_ids
        assert ids == b.outputs[0].token_ids and len(a.outputs[0].logprobs) == 24
        np.testing.assert_allclose(chosen(a.outputs[0].logprobs, ids), chosen(b.outputs[0].logprobs, ids), atol=1e-4)
        np.testing.assert_allclose(
            chosen(a.prompt_logprobs, a.prompt_token_ids), chosen(b.prompt_logprobs, b.prompt_token_ids), atol=1e-4
        )


def test_streaming_deltas_add_up_to_generate(llm):
    prompts = ["Stream me", "And me too"]
    final = {o.prompt: o for o in llm.generate(prompts, SCORED, use_tqdm=False)}
    logprobs = {p: [] for p in prompts}
    prompt_logprobs = {p: [] for p in prompts}
    for out in llm.generate_stream(prompts, SCORED):
        for c in out.outputs:
            assert len(c.logprobs) == len(c.token_ids)
            logprobs[out.prompt] += c.logprobs
            cumulative = c.cumulative_logprob
        if out.prompt_logprobs is not None:
            prompt_logprobs[out.prompt].append(out.prompt_logprobs)
        if out.finished:
            assert cumulative == pytest.approx(final[out.prompt].outputs[0].cumulative_logprob)
    for p in prompts:
        assert logprobs[p] == final[p].outputs[0].logprobs
        assert prompt_logprobs[p] == [final[p].prompt_logprobs]  # sent once


def test_n_completions_have_their_own_logprobs(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    stats = llm.llm_engine.block_manager.stats
    hits = stats.hits
    (out,) = llm.generate(PROMPT, params, use_tqdm=False)
    assert stats.hits - hits == 2 * 48  # only the first child scores the prompt; the others hit its blocks
    (one,) = llm.generate(PROMPT, SCORED, use_tqdm=False)
    for c in out.outputs:
        assert [list(e) for e in c.logprobs] == [[t] for t in c.token_ids]
        assert c.cumulative_logprob == pytest.approx(chosen(c.logprobs, c.token_ids).sum())
    assert len({c.cumulative_logprob for c in out.outputs}) == 3
    prompt = out.prompt_token_ids
    np.testing.assert_allclose(chosen(out.prompt_logprobs, prompt), chosen(one.prompt_logprobs, prompt), atol=1e-4)


def test_stopped_outputs_keep_logprobs_aligned_with_token_ids(llm):
    base = llm.generate(PROMPT, SCORED, use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    stop_string = tok.decode(base.token_ids[2:4])
    by_string = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3, stop=[stop_string])
    by_id = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3, stop_token_ids=[base.token_ids[3]])
    for params in (by_string, by_id):
        c = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
        assert c.finish_reason == "stop" and c.token_ids == base.token_ids[: len(c.token_ids)]
        assert [list(e) for e in c.logprobs] == [list(e) for e in base.logprobs[: len(c.token_ids)]]
        np.testing.assert_allclose(chosen(c.logprobs, c.token_ids), chosen(base.logprobs, c.token_ids), atol=1e-4)
        assert c.cumulative_logprob == pytest.approx(chosen(c.logprobs, c.token_ids).sum())


def test_without_a_tokenizer_tokens_have_no_text_and_max_logprobs_applies():
    llm = LLM(skip_tokenizer_init=True, max_logprobs=2, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=2, prompt_logprobs=1)
    (out,) = llm.generate([1, 40, 41, 42], params, use_tqdm=False)
    entries = [*out.outputs[0].logprobs, *out.prompt_logprobs[1:]]
    assert all(e.decoded_token is None for d in entries for e in d.values())
    with pytest.raises(ValueError, match="maximum of 2"):
        llm.generate([1, 40], SamplingParams(logprobs=3), use_tqdm=False)
