"""Runner.step: bad input is refused without side effects; the compiled step never copies the KV cache."""

from __future__ import annotations

from dataclasses import replace

import jax
import numpy as np
import pytest

from jaxrunner import CachedRequestData, ModelConfig, NewRequestData, Runner, RunnerConfig, SamplingParams, SchedulerOutput
from jaxrunner.models.llama import init_params
from jaxrunner.runner.memory import kv_cache_bytes

MODEL = ModelConfig(
    "LlamaForCausalLM", vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8
)
CONFIG = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=40, block_size=4, num_blocks=32)
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def params():
    return init_params(MODEL, jax.random.key(0), std=0.3)


def new(rid: str, prompt: list[int], blocks: list[int], **kw) -> NewRequestData:
    return NewRequestData(rid, prompt, (blocks,), sampling_params=GREEDY, **kw)


def sched(new_reqs=(), cached=CachedRequestData(), scheduled=None, **kw) -> SchedulerOutput:
    scheduled = scheduled or {}
    return SchedulerOutput(list(new_reqs), cached, scheduled, sum(scheduled.values()), **kw)


FIRST = sched([new("a", [5, 6, 7, 8, 9], [3, 7]), new("b", [1, 2, 3], [11])], scheduled={"a": 5, "b": 3})


def decode(a_computed=5, b_computed=3, new_blocks=(None, None)):
    return sched(
        cached=CachedRequestData(["a", "b"], list(new_blocks), [a_computed, b_computed]), scheduled={"a": 1, "b": 1}
    )


BAD = {
    "unknown request": sched(cached=CachedRequestData(["zz"], [None], [0]), scheduled={"zz": 1}),
    "duplicate new request": sched([new("a", [1, 2], [1])], scheduled={"a": 2}),
    "duplicate within one step": sched([new("c", [1], [1]), new("c", [2], [2])], scheduled={"c": 2}),
    "too many tokens": sched([new("c", list(range(33)), list(range(12, 21)))], scheduled={"c": 33}),
    "block id outside the cache": sched([new("c", [1, 2], [32])], scheduled={"c": 2}),
    "negative block id": sched([new("c", [1, 2], [-1])], scheduled={"c": 2}),
    "token outside the vocabulary": sched([new("c", [1, 97], [1])], scheduled={"c": 2}),
    "longer than max_model_len": sched([new("c", list(range(41)), list(range(12, 23)))], scheduled={"c": 20}),
    "too few blocks": sched([new("c", list(range(9)), [12, 13])], scheduled={"c": 9}),
    "more tokens than known": decode(a_computed=6),
    "wrong total": replace(decode(), total_num_scheduled_tokens=5),
    "unscheduled cached request": sched(cached=CachedRequestData(["a"], [None], [5]), scheduled={"a": 1, "b": 1}),
    "speculative tokens": replace(decode(), scheduled_spec_decode_tokens={"a": [1]}),
    "logit bias outside the vocabulary": sched(
        [NewRequestData("c", [1, 2], ([12],), sampling_params=SamplingParams(logit_bias={200: 1.0}))], scheduled={"c": 2}
    ),
    "too many logprobs": sched(
        [NewRequestData("c", [1, 2], ([12],), sampling_params=SamplingParams(logprobs=21))], scheduled={"c": 2}
    ),
    "too many requests": sched(
        [new(f"n{i}", [1], [12 + i]) for i in range(3)], scheduled={f"n{i}": 1 for i in range(3)}
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_refused_and_changes_nothing(params, case):
    runner = Runner(MODEL, params, CONFIG)
    state, first = runner.step(runner.init_state(), FIRST)
    with pytest.raises(ValueError, match="rejected|outside|longer|logprobs"):
        runner.step(state, BAD[case])
    state, after = runner.step(state, decode())

    clean = Runner(MODEL, params, CONFIG)
    clean_state, clean_first = clean.step(clean.init_state(), FIRST)
    _, expected = clean.step(clean_state, decode())
    assert first.sampled_token_ids == clean_first.sampled_token_ids
    assert after.sampled_token_ids == expected.sampled_token_ids


def test_finished_and_preempted_free_slots(params):
    runner = Runner(MODEL, params, CONFIG)
    state, _ = runner.step(runner.init_state(), FIRST)
    more = [new(f"n{i}", [1, 2], [12 + i]) for i in range(2)]
    state, _ = runner.step(state, sched(more, scheduled={"n0": 2, "n1": 2}))
    with pytest.raises(ValueError, match="max_num_seqs"):
        runner.step(state, sched([new("x", [1], [20])], scheduled={"x": 1}))
    freed = sched([new("x", [1], [20])], scheduled={"x": 1}, finished_req_ids={"a"}, preempted_req_ids={"b"})
    state, out = runner.step(state, freed)
    assert out.req_ids == ["x"] and len(out.sampled_token_ids[0]) == 1
    with pytest.raises(ValueError, match="unknown request"):
        runner.step(state, decode(a_computed=6, b_computed=4))


def test_non_final_prefill_chunk_samples_nothing(params):
    runner = Runner(MODEL, params, CONFIG)
    state, out = runner.step(runner.init_state(), sched([new("a", list(range(10)), [0, 1, 2])], scheduled={"a": 4}))
    assert out.sampled_token_ids == [[]]
    step2 = sched(cached=CachedRequestData(["a"], [None], [4]), scheduled={"a": 6})
    state, out = runner.step(state, step2)
    assert len(out.sampled_token_ids[0]) == 1


def test_compiled_step_does_not_copy_the_kv_cache(params):
    config = replace(CONFIG, num_blocks=4096)
    runner = Runner(MODEL, params, config)
    stats = runner.compile_forward(config.max_num_batched_tokens).memory_analysis()
    cache = kv_cache_bytes(MODEL, config)
    assert stats.alias_size_in_bytes >= cache, "the KV cache must be updated in place (donated and aliased)"
    assert stats.temp_size_in_bytes < cache / 10, f"temp {stats.temp_size_in_bytes} B vs cache {cache} B: a copy?"
    assert stats.output_size_in_bytes - stats.alias_size_in_bytes < cache / 10


def test_state_structure_never_changes(params):
    runner = Runner(MODEL, params, CONFIG)
    state = runner.init_state()
    structure = jax.tree.structure(state)
    shapes = [x.shape for x in jax.tree.leaves(state)]
    state, _ = runner.step(state, FIRST)
    state, _ = runner.step(state, decode())
    assert jax.tree.structure(state) == structure
    assert [x.shape for x in jax.tree.leaves(state)] == shapes
    assert np.asarray(state.token_ids)[:2].any()


def test_attention_soft_cap_reaches_both_kernel_paths(params):
    """Gemma 2's attention soft-cap (ModelConfig.attn_soft_cap): it changes the logprobs, and the
    Pallas kernels (interpreted) and the jnp reference agree on them."""
    with_logprobs = SamplingParams(temperature=0.0, logprobs=5)

    def first_logprobs(model: ModelConfig, kernels: str) -> np.ndarray:
        runner = Runner(model, params, replace(CONFIG, kernels=kernels))
        request = replace(new("a", [5, 6, 7, 8, 9], [3, 7]), sampling_params=with_logprobs)
        step = sched([request], scheduled={"a": 5})
        return runner.step(runner.init_state(), step)[1].logprobs["a"].logprobs

    capped = replace(MODEL, attn_soft_cap=0.5)
    reference = first_logprobs(capped, "reference")
    np.testing.assert_allclose(first_logprobs(capped, "pallas"), reference, rtol=1e-4, atol=1e-5)
    assert not np.allclose(first_logprobs(MODEL, "reference"), reference, atol=1e-3)
