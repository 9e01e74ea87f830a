"""After `Runner.warmup`, a varied workload compiles nothing new; and what keeps warm-up short."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
from driver import drive
from jaxrunner import LLM, Runner, RunnerConfig, SamplingParams
from jaxrunner.bench.shapes import shape
from jaxrunner.input_batch import RequestTable, build_inputs
from jaxrunner.loader import load_model
from jaxrunner.models.llama import init_params
from jaxrunner.program_cache import ProgramCache
from jaxrunner.programs import Programs
from jaxrunner.step import forward_step

MODEL = Path(__file__).parent / "data" / "models" / "tiny-qwen2"
DECODE_FORMS = int(jax.default_backend() == "gpu")  # on GPU, the 16-token bucket's decode-kernel backbone


def test_varied_workload_after_warmup_compiles_nothing():
    cfg, params = load_model(MODEL, "float32")
    config = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=96, block_size=8, num_blocks=64)
    runner = Runner(cfg, params, config)
    report = runner.warmup(runner.init_state())
    # 3 token buckets x (backbone + prompt logprobs), 3 request buckets x (block write + 6 sampler variants)
    assert report["programs"] == 3 * 2 + DECODE_FORMS + 3 * 7 and report["kv_cache_tokens"] == 512
    compiled = runner.programs.compiled_on_use

    prompts = [list(range(3, 3 + n)) for n in (5, 30, 61, 12)]
    mixed = [
        SamplingParams(temperature=0.0, logprobs=2, prompt_logprobs=1),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=1),
        SamplingParams(temperature=1.0, repetition_penalty=1.2, min_tokens=3, stop_token_ids=[7], seed=2),
        SamplingParams(temperature=0.7, min_p=0.1, logit_bias={9: 2.0}, bad_words=None, seed=3),
    ]
    drive(runner, prompts, 12, params=mixed, chunk=13, stagger=2, preempt={6: [1], 9: [2, 3]})
    drive(runner, prompts[:2], 6)
    assert runner.programs.compiled_on_use == compiled


def test_engine_warms_up_multi_step_decode_and_then_compiles_nothing():
    llm = LLM(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64, enforce_eager=False, num_scheduler_steps=4)
    runner = llm.llm_engine.runner
    assert llm.llm_engine.startup["programs"] == 2 * 2 + DECODE_FORMS + 2 * (1 + 6 + 2)  # + multi-step decode: plain, with logprobs
    compiled = runner.programs.compiled_on_use
    params = [
        SamplingParams(temperature=0.0, max_tokens=9, logprobs=1),
        SamplingParams(temperature=0.9, top_p=0.8, max_tokens=7, seed=4, presence_penalty=0.3),
    ]
    outs = llm.generate(["Hello there, how are", "A longer prompt that needs a second chunk of tokens"], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [9, 7]
    assert runner.programs.compiled_on_use == compiled


def test_a_step_lowers_its_layer_once_for_all_layers():
    # Lowering each layer (on a GPU, its Pallas kernels into Triton) was most of start-up.
    model = dataclasses.replace(shape("tiny"), num_layers=4)
    config = RunnerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, num_blocks=64)
    runner = Runner(model, init_params(model, jax.random.key(0)), config)
    tokens = build_inputs(RequestTable.empty(config.max_num_seqs), [], {}, config, runner.sampler_config, 16, 1)[0]
    step = jax.jit(forward_step, static_argnames=("model", "uniform_decode"))
    text = step.lower(runner.params, runner.init_state(), tokens, model=model, uniform_decode=False).as_text()
    assert len(re.findall(r"func\.func private @decoder_layer\b", text)) == 1
    assert len(re.findall(r"call @decoder_layer\b", text)) == 4


def _runner_and_programs() -> tuple[Runner, list]:
    cfg, params = load_model(MODEL, "float32")
    runner = Runner(cfg, params, RunnerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=48, block_size=8, num_blocks=16))
    return runner, runner.warmup_programs(runner.init_state())


def test_program_cache_loads_every_program_without_lowering_and_runs_the_same(tmp_path):
    runner, programs = _runner_and_programs()
    stored = Programs(ProgramCache(tmp_path))
    stored.compile_all(programs)
    assert len(list(tmp_path.glob("*.jaxexe"))) == len(programs) and stored.loaded == 0

    prompts = [list(range(3, 3 + n)) for n in (5, 19)]
    params = [SamplingParams(temperature=0.0, logprobs=2, prompt_logprobs=1), SamplingParams(temperature=0.8, top_k=5, seed=1)]
    runs = []
    for fresh in (Programs(ProgramCache(tmp_path)), Programs()):
        runner.programs = fresh
        report = runner.warmup(runner.init_state())
        assert report["compiled"] == len(programs)
        runs.append((report["loaded_from_cache"], report["lowering_seconds"] > 0, drive(runner, prompts, 6, params=params, chunk=7)))
        assert fresh.compiled_on_use == 0
    assert runs[0][:2] == (len(programs), False) and runs[1][:2] == (0, True)
    assert runs[0][2] == runs[1][2]


def test_program_cache_keys_are_the_same_in_another_process(tmp_path):
    # A key must not depend on object ids or hash seeds, or a new process never finds its programs.
    script = (
        "import json, sys; sys.path[:0] = %r; from test_warmup import _runner_and_programs; "
        "from jaxrunner.program_cache import ProgramCache; cache = ProgramCache('unused'); runner, programs = _runner_and_programs(); "
        "print(json.dumps([cache.key(p.fn, p.key, p.args, p.statics) for p in programs]))"
    ) % [str(Path(__file__).parent), str(Path(__file__).parents[1])]
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env={**os.environ, "PYTHONHASHSEED": "7"})
    cache = ProgramCache(tmp_path)
    _, programs = _runner_and_programs()
    keys = [cache.key(p.fn, p.key, p.args, p.statics) for p in programs]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == keys and len(set(keys)) == len(keys)


def test_a_cached_program_that_does_not_load_is_compiled_again_and_rewritten(tmp_path, caplog):
    program = _runner_and_programs()[1][-1]
    Programs(ProgramCache(tmp_path)).compile_all([program])
    [path] = tmp_path.glob("*.jaxexe")
    path.write_bytes(path.read_bytes()[:100])
    runs = [Programs(ProgramCache(tmp_path)) for _ in range(2)]
    for programs in runs:
        programs.compile_all([program])
    assert [p.loaded for p in runs] == [0, 1] and "cannot load the cached program" in caplog.text
