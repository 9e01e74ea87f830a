"""Async scheduling and multi-step decode change when tokens reach the host, never which tokens:
the engine's outputs (tokens, logprobs, text, finish reasons) are the same in every mode, through
stop tokens, stop strings, max_tokens, min_tokens, seeds, penalties, n > 1 and preemption."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxrunner import RunnerConfig, SamplingParams
from jaxrunner.engine import LLM
from jaxrunner.engine.default_model import TINY_MODEL, default_model
from jaxrunner.runner import Runner
from jaxrunner.step_io import CachedRequestData, NewRequestData, SchedulerOutput, decode_steps

ENGINE = {"model": TINY_MODEL, "max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 96}
PROMPTS = ["Hello, my name is", "The capital of France", "abc", "Once upon a time, far away,"]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=1.0, seed=7, top_k=20, max_tokens=17, stop=["e"], presence_penalty=0.5),
    SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=13, min_tokens=6, stop_token_ids=[40, 41, 42, 43]),
    SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.3),
]


def generate(**engine) -> tuple[list[tuple], list, int]:
    """Per completion: tokens, text, finish and stop reason, logprob ids and ranks; the logprob values
    apart (batches of other sizes may change their last bits); the engine's preemption count."""
    llm = LLM(**ENGINE, **engine)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    completions = [c for o in outs for c in o.outputs]
    exact = [
        (c.token_ids, c.text, c.finish_reason, c.stop_reason,
         c.logprobs and [sorted((t, lp.rank) for t, lp in d.items()) for d in c.logprobs])
        for c in completions
    ]
    values = [c.logprobs and [[d[t].logprob for t in sorted(d)] for d in c.logprobs] for c in completions]
    return exact, values, llm.llm_engine.scheduler.num_preemptions


def assert_same(got: tuple, want: tuple) -> None:
    assert got[0] == want[0]
    for a, b in zip(got[1], want[1], strict=True):
        assert (a is None) == (b is None)
        for row_a, row_b in zip(a or [], b or [], strict=True):
            np.testing.assert_allclose(row_a, row_b, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def reference():
    return generate(async_scheduling=False, num_scheduler_steps=1)


@pytest.mark.parametrize("async_scheduling, steps", [(True, 1), (False, 4), (True, 4)])
def test_same_outputs_in_every_mode(reference, async_scheduling, steps):
    assert_same(generate(async_scheduling=async_scheduling, num_scheduler_steps=steps), reference)


def test_same_outputs_after_warm_up(reference):
    """Warm, the plain-sampling batches run compiled decode loops and the others (penalties, top-k)
    their rounds one by one through the single-step programs; nothing is compiled on use."""
    assert_same(generate(async_scheduling=True, num_scheduler_steps=4, enforce_eager=False), reference)


def test_same_outputs_under_preemption(reference):
    outputs = generate(async_scheduling=True, num_scheduler_steps=4, num_gpu_blocks_override=12, block_size=8)
    assert outputs[2] > 0
    assert_same(outputs, reference)


def test_decode_steps_respects_limits():
    sp = SamplingParams(max_tokens=10, min_tokens=4)
    assert decode_steps(8, num_tokens=20, num_outputs=1, params=sp, max_model_len=64) == 3  # to min_tokens
    assert decode_steps(8, num_tokens=23, num_outputs=4, params=sp, max_model_len=64) == 6  # to max_tokens
    assert decode_steps(8, num_tokens=60, num_outputs=4, params=sp, max_model_len=64) == 4  # to the model length
    assert decode_steps(8, 20, 4, dataclasses.replace(sp, max_tokens=None), 64) == 8


def test_runner_multi_step_returns_every_step_and_checks_its_input():
    cfg, params = default_model()
    runner = Runner(cfg, params, RunnerConfig(max_num_seqs=2, max_model_len=64, block_size=4, num_blocks=32))
    state = runner.init_state()
    greedy = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    new = NewRequestData("a", [5, 6, 7], ([0],), sampling_params=greedy)
    state, out = runner.step(state, SchedulerOutput([new], num_scheduled_tokens={"a": 3}, total_num_scheduled_tokens=3))
    decode = SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(["a"], [([1, 2],)], [3]),
        num_scheduled_tokens={"a": 1}, total_num_scheduled_tokens=1, num_steps=6,
    )
    state, multi = runner.step(state, decode)
    single = Runner(cfg, params, runner.config)
    s2, first = single.step(single.init_state(), SchedulerOutput([new], num_scheduled_tokens={"a": 3}, total_num_scheduled_tokens=3))
    tokens = first.sampled_token_ids[0]
    for i in range(6):
        sched = SchedulerOutput(
            scheduled_cached_reqs=CachedRequestData(["a"], [([1, 2],)] if i == 0 else [None], [3 + i]),
            num_scheduled_tokens={"a": 1}, total_num_scheduled_tokens=1,
        )
        s2, o = single.step(s2, sched)
        tokens += o.sampled_token_ids[0]
    assert out.sampled_token_ids[0] + multi.sampled_token_ids[0] == tokens

    stop = tokens[3]  # the third token of the multi-step call: stops are the scheduler's to apply
    runner2 = Runner(cfg, params, runner.config)
    s3, _ = runner2.step(runner2.init_state(), SchedulerOutput(
        [dataclasses.replace(new, sampling_params=dataclasses.replace(greedy, stop_token_ids=[stop]))],
        num_scheduled_tokens={"a": 3}, total_num_scheduled_tokens=3))
    s3, uncut = runner2.step(s3, decode)
    assert uncut.sampled_token_ids[0] == tokens[1:]

    fresh = Runner(cfg, params, runner.config)
    s4, _ = fresh.step(fresh.init_state(), SchedulerOutput([new], num_scheduled_tokens={"a": 3}, total_num_scheduled_tokens=3))
    no_blocks = dataclasses.replace(decode, scheduled_cached_reqs=CachedRequestData(["a"], [None], [3]))
    with pytest.raises(ValueError, match="1 blocks cannot hold 9 tokens"):
        fresh.step(s4, no_blocks)
    prefill = dataclasses.replace(decode, scheduled_new_reqs=[dataclasses.replace(new, req_id="b", block_ids=([9],))],
                                  num_scheduled_tokens={"a": 1, "b": 3}, total_num_scheduled_tokens=4)
    with pytest.raises(ValueError, match="needs one-token decodes"):
        fresh.step(s4, prefill)
