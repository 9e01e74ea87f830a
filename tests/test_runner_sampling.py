"""The full sampler inside Runner.step: logprobs, prompt logprobs, NaN counts and per-request features,
checked against the Hugging Face goldens and against the same request run alone."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from driver import drive

from jaxrunner import Runner, RunnerConfig, SamplingParams
from jaxrunner.checkpoints.loader import load_model

DATA = Path(__file__).parent / "data"
CONFIG = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=128, max_model_len=128, block_size=8, num_blocks=96)


@pytest.fixture(scope="module")
def llama():
    cfg, params = load_model(DATA / "models" / "tiny-llama", "float32")
    g = np.load(DATA / "goldens" / "tiny-llama.npz")
    return Runner(cfg, params, CONFIG), [g[f"prompt_{i}"].tolist() for i in range(4)], [g[f"logits_{i}"] for i in range(4)]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)


@pytest.mark.parametrize("chunk", [None, 7])
def test_prompt_logprobs_match_hf_and_come_once(llama, chunk):
    runner, prompts, logits = llama
    params = [SamplingParams(temperature=0.0, prompt_logprobs=3)] * 4
    outputs = []
    drive(runner, prompts, 2, params=params, chunk=chunk, stagger=1, outputs=outputs)
    emitted = [(rid, lp) for out in outputs for rid, lp in out.prompt_logprobs_dict.items()]
    assert sorted(rid for rid, _ in emitted) == ["0", "1", "2", "3"], "each prompt's logprobs come exactly once"
    for rid, lp in emitted:
        prompt, ref = prompts[int(rid)], log_softmax(logits[int(rid)])
        targets = np.array(prompt[1:])
        assert lp.token_ids.shape == (len(prompt) - 1, 4)
        np.testing.assert_array_equal(lp.token_ids[:, 0], targets)
        np.testing.assert_allclose(lp.logprobs[:, 0], ref[np.arange(len(targets)), targets], atol=2e-4)
        np.testing.assert_array_equal(lp.token_ids[:, 1:], np.argsort(-ref[:-1], axis=1, kind="stable")[:, :3])
        ranks = (ref[:-1] >= ref[np.arange(len(targets)), targets][:, None] - 1e-9).sum(1)
        np.testing.assert_array_equal(lp.ranks, ranks)


def test_resumed_request_does_not_rescore_its_prompt(llama):
    runner, prompts, _ = llama
    outputs = []
    params = [SamplingParams(temperature=0.0, prompt_logprobs=1)] * 2
    drive(runner, prompts[2:], 8, params=params, chunk=16, preempt={5: [1]}, outputs=outputs)
    emitted = [rid for out in outputs for rid in out.prompt_logprobs_dict]
    assert sorted(emitted) == ["0", "1"]


def test_sampled_logprobs_are_the_log_softmax_of_the_next_token(llama):
    runner, prompts, logits = llama
    outputs = []
    tokens = drive(runner, prompts, 1, params=[SamplingParams(temperature=0.0, logprobs=5)] * 4, outputs=outputs)
    got = {rid: lp for out in outputs for rid, lp in out.logprobs.items()}
    for i, prompt in enumerate(prompts):
        ref = log_softmax(logits[i][-1])
        lp = got[str(i)]
        assert lp.token_ids.shape == (1, 6) and lp.token_ids[0, 0] == tokens[i][0] == np.argmax(ref)
        np.testing.assert_allclose(lp.logprobs[0], ref[lp.token_ids[0]], atol=2e-4)
        np.testing.assert_array_equal(lp.token_ids[0, 1:], np.argsort(-ref, kind="stable")[:5])
        assert lp.ranks[0] == 1
    assert all(n == 0 for out in outputs for n in out.num_nans_in_logits.values())


FEATURES = {
    "top-k": SamplingParams(temperature=1.0, top_k=3, seed=11),
    "top-p + min-p": SamplingParams(temperature=0.7, top_p=0.8, min_p=0.05, seed=12),
    "penalties": SamplingParams(temperature=0.9, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4, seed=13),
    "bias + allowed": SamplingParams(temperature=1.0, allowed_token_ids=[5, 6, 7, 8], logit_bias={5: -100.0}, seed=14),
    "min tokens": SamplingParams(temperature=1.0, min_tokens=6, stop_token_ids=[9], seed=15),
}


@pytest.mark.parametrize("name", list(FEATURES))
def test_each_feature_gives_the_same_tokens_alone_and_in_a_mixed_batch(llama, name):
    runner, prompts, _ = llama
    params = FEATURES[name]
    alone = drive(runner, [prompts[1]], 8, params=[params])[0]
    others = [SamplingParams(temperature=0.0), params, replace(FEATURES["penalties"], seed=3), SamplingParams(temperature=1.0, top_k=50)]
    mixed = drive(runner, [prompts[0], prompts[1], prompts[2], prompts[3]], 8, params=others, chunk=9, stagger=1)[1]
    assert mixed == alone
    if name == "bias + allowed":
        assert set(alone) <= {6, 7, 8}
