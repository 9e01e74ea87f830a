"""After `Runner.warmup`, a varied workload compiles nothing new."""

from __future__ import annotations

from pathlib import Path

from driver import drive
from jaxrunner import Runner, RunnerConfig, SamplingParams
from jaxrunner import runner as runner_module
from jaxrunner.loader import load_model

MODEL = Path(__file__).parent / "data" / "models" / "tiny-qwen2"
JITTED = ("_forward", "_sample", "_write_blocks", "_prompt_logprobs")


def cache_sizes() -> dict[str, int]:
    return {name: getattr(runner_module, name)._cache_size() for name in JITTED}


def test_varied_workload_after_warmup_compiles_nothing():
    cfg, params = load_model(MODEL, "float32")
    config = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=96, block_size=8, num_blocks=64)
    runner = Runner(cfg, params, config)
    state, report = runner.warmup(runner.init_state())
    assert report["graphs"] == 3 + 3 + 3 * 6 + 3 and report["kv_cache_tokens"] == 512
    warm = cache_sizes()

    prompts = [list(range(3, 3 + n)) for n in (5, 30, 61, 12)]
    mixed = [
        SamplingParams(temperature=0.0, logprobs=2, prompt_logprobs=1),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=1),
        SamplingParams(temperature=1.0, repetition_penalty=1.2, min_tokens=3, stop_token_ids=[7], seed=2),
        SamplingParams(temperature=0.7, min_p=0.1, logit_bias={9: 2.0}, bad_words=None, seed=3),
    ]
    drive(runner, prompts, 12, params=mixed, chunk=13, stagger=2, preempt={6: [1], 9: [2, 3]})
    drive(runner, prompts[:2], 6)
    assert cache_sizes() == warm


def test_engine_warms_up_when_asked_and_then_compiles_nothing():
    from jaxrunner import LLM

    llm = LLM(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64, enforce_eager=False)
    warm = cache_sizes()
    params = [SamplingParams(temperature=0.0, max_tokens=5), SamplingParams(temperature=0.9, top_p=0.8, max_tokens=7, seed=4)]
    outs = llm.generate(["Hello there, how are", "A longer prompt that needs a second chunk of tokens"], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 7]
    assert cache_sizes() == warm
