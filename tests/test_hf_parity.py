"""Parity with Hugging Face transformers on tiny committed checkpoints (goldens made by scripts/make_goldens.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from driver import drive, prompt_logits

from jaxrunner import Runner, RunnerConfig, SamplingParams
from jaxrunner.checkpoints.loader import load_model

DATA = Path(__file__).parent / "data"
MODELS = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-gemma2", "tiny-gemma3", "tiny-qwen3-moe",
          "tiny-mixtral"]
CONFIG = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=128, max_model_len=128, block_size=8, num_blocks=96)


def goldens(name: str) -> tuple[list[list[int]], list[np.ndarray], list[list[int]]]:
    g = np.load(DATA / "goldens" / f"{name}.npz")
    n = len([k for k in g.files if k.startswith("prompt_")])
    return (
        [g[f"prompt_{i}"].tolist() for i in range(n)],
        [g[f"logits_{i}"] for i in range(n)],
        [g[f"greedy_{i}"].tolist() for i in range(n)],
    )


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    cfg, params = load_model(DATA / "models" / request.param, "float32")
    return request.param, cfg, params, Runner(cfg, params, CONFIG)


@pytest.mark.parametrize("chunk", [128, 7])
def test_prompt_logits_match_hf(model, chunk):
    name, cfg, params, _ = model
    prompts, logits, _ = goldens(name)
    for prompt, ref in zip(prompts, logits):
        ours = prompt_logits(cfg, params, prompt, chunk)
        rel = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
        assert rel < 1e-4, f"{name}: relative error {rel:.2e} on a {len(prompt)}-token prompt"


@pytest.mark.parametrize(
    "how",
    [
        dict(),
        dict(chunk=7, stagger=3),
        dict(chunk=16, preempt={12: [1, 3], 20: [0]}),
    ],
    ids=["whole-prompts", "chunked-7-mixed", "preempt-resume"],
)
def test_greedy_generation_matches_hf(model, how):
    name, _, _, runner = model
    prompts, _, greedy = goldens(name)
    assert drive(runner, prompts, 32, **how) == greedy


def test_seeded_sampling_is_batch_independent(model):
    name, _, _, runner = model
    prompts, _, _ = goldens(name)
    seeded = SamplingParams(temperature=0.8, seed=1234)
    alone = drive(runner, [prompts[2]], 16, params=[seeded])[0]
    others = [SamplingParams(temperature=1.0), seeded, SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, seed=7)]
    mixed = drive(runner, [prompts[0], prompts[2], prompts[1], prompts[3]], 16, params=others, chunk=9, stagger=2)
    assert mixed[1] == alone
    reseeded = drive(runner, [prompts[2]], 16, params=[SamplingParams(temperature=0.8, seed=4321)])[0]
    assert reseeded != alone, "a different seed should give different tokens"


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-qwen3-moe"])
def test_greedy_generation_with_the_pallas_kernels_matches_hf(name):
    """The runner with the Pallas attention, KV write and decode kernels (and the MoE grouped
    matmul: `test_grouped_matmul.py` shows the runner picks it), interpreted on the CPU."""
    cfg, params = load_model(DATA / "models" / name, "float32")
    runner = Runner(cfg, params, dataclasses.replace(CONFIG, kernels="pallas"))
    prompts, _, greedy = goldens(name)
    assert drive(runner, prompts, 32, chunk=7, stagger=3) == greedy
    assert runner.kernels.pallas and any(key[0] == "forward" and key[2] for key in runner.programs.asked)
