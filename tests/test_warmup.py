"""After `Runner.warmup`, a varied workload compiles nothing new; and what keeps warm-up short."""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache
from driver import drive

from jaxrunner import LLM, NewRequestData, Runner, RunnerConfig, SamplingParams, SchedulerOutput, platform
from jaxrunner.engine import engine as engine_module
from jaxrunner.engine.engine import LLMEngine
from jaxrunner.engine.engine_args import EngineArgs
from jaxrunner.runner import programs as programs_table
from jaxrunner.engine.default_model import TINY_MODEL
from jaxrunner.checkpoints.loader import load_model
from jaxrunner.models.llama import init_params
from jaxrunner.checkpoints.dummy import shape
from jaxrunner.runner import program_cache
from jaxrunner.runner.program_cache import ProgramCache
from jaxrunner.runner.programs import Programs

MODEL = Path(__file__).parent / "data" / "models" / "tiny-qwen2"
KINDS = {kind.name for kind in programs_table.KINDS}
MIXED = [
    SamplingParams(temperature=0.0, logprobs=2, prompt_logprobs=1),
    SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=1),
    SamplingParams(temperature=1.0, repetition_penalty=1.2, min_tokens=3, stop_token_ids=[7], seed=2),
    SamplingParams(temperature=0.7, min_p=0.1, logit_bias={9: 2.0}, seed=3),
]


@pytest.mark.parametrize("kernels, decode_forms", [("reference", 0), ("pallas", 1)])
def test_every_program_a_varied_workload_asks_for_was_warmed_up(kernels, decode_forms, caplog, monkeypatch):
    """Through the engine: chunked prefill, preemption, prompt logprobs, every sampler variant,
    multi-step decode in one call (plain sampling) and round by round (the others); with the
    Pallas kernels (interpreted here) the decode form of the backbone too. Warm-up's progress is
    logged (stderr is no terminal here), ending with every program ready. No KV page is alive
    while warm-up compiles (XLA's GPU autotuner allocates as it compiles), and on a CPU no program
    runs ahead of the workload."""
    caplog.set_level(logging.INFO, logger="jaxrunner.engine.warmup_progress")
    live, compile_all, ran, run_each_once = [], Programs.compile_all, [], Runner.run_each_once
    monkeypatch.setattr(Programs, "compile_all", lambda self, *args, **kwargs: live.append(
        {x.shape for x in jax.live_arrays()}) or compile_all(self, *args, **kwargs))
    monkeypatch.setattr(Runner, "run_each_once", lambda self, state: ran.append(self) or run_each_once(self, state))
    llm = LLM(TINY_MODEL, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=96, block_size=8, num_gpu_blocks_override=16,
              num_scheduler_steps=4, enforce_eager=False, kernels=kernels)
    pages = {x.shape for x in jax.tree.leaves(llm.llm_engine.state.kv)}
    assert live and not any(pages & shapes for shapes in live)
    assert not ran  # first runs are a GPU's cost (their kernels load): on a CPU warm-up leaves them out
    programs = llm.llm_engine.runner.programs
    # 2 token buckets x (backbone + prompt logprobs) + the decode forms (the 16-token bucket holds a
    # decode batch); one request bucket (4: the buckets start at 16 or max_num_seqs) x (block and token-row
    # writes + 12 sampler variants + 2 decode loops)
    assert llm.llm_engine.startup["programs"] == len(programs.warm) == 2 * 2 + decode_forms + (2 + 12 + 2)
    total = len(programs.warm)
    assert caplog.messages[-1].startswith(f"warm-up: {total} of {total} programs ready")
    programs.asked.clear()  # what the workload asks for, from here (on a GPU warm-up ran each program once)
    prompts = ["Hello there, how are", "A longer prompt that needs a second chunk of tokens", "x", "Once upon a time"]
    outs = llm.generate(prompts, [dataclasses.replace(p, max_tokens=14) for p in MIXED], use_tqdm=False)
    plain = llm.generate(prompts[:2], SamplingParams(temperature=0.9, seed=5, max_tokens=14, logprobs=1), use_tqdm=False)
    assert all(o.finished and o.error is None for o in outs + plain) and llm.llm_engine.scheduler.num_preemptions > 0
    assert programs.asked <= programs.warm and programs.compiled_on_use == 0
    # no drafts, no LoRA, no host tier here
    assert {key[0] for key in programs.asked} == KINDS - {"spec_sample", "write_lora", "gather_blocks", "stack_pieces", "scatter_blocks"}
    assert any(key[0] == "forward" and key[2] for key in programs.asked) == bool(decode_forms)
    # warm-up's objects are out of the collector's way (a full collection walked them all) until the
    # last engine that froze them closes (a second one stands in here)
    assert gc.get_freeze_count() > len(gc.get_objects())
    engine_module._freeze_objects()
    llm.close()
    assert gc.get_freeze_count() > len(gc.get_objects())
    engine_module._thaw_objects()
    assert gc.get_freeze_count() == 0


def test_a_runner_driven_directly_after_warmup_compiles_nothing():
    cfg, params = load_model(MODEL, "float32")
    config = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=96, block_size=8, num_blocks=64)
    runner = Runner(cfg, params, config)
    heard = []
    report = runner.warmup(lambda done, total: heard.append((done, total)))
    # 3 token buckets x (backbone + prompt logprobs), one request bucket (4) x (block and token-row writes + 12
    # sampler variants), and with the Pallas kernels the decode form of the one token bucket a decode batch lands in
    assert report["programs"] == 3 * 2 + 14 + runner.kernels.pallas and report["kv_cache_tokens"] == 512
    # the lowering's seconds split by program kind, tracing a part of them
    by_kind = report["lowering_seconds_by_kind"]
    assert {"forward", "sample", "write_blocks"} <= by_kind.keys()
    assert sum(by_kind.values()) == pytest.approx(report["lowering_seconds"], abs=0.01 * len(by_kind))
    assert 0 < report["tracing_seconds"] < report["lowering_seconds"]
    # each compile thread's seconds, by kind, and the longest compiles: every program compiled here is in them
    assert report["compile_thread_seconds_by_kind"].keys() == by_kind.keys()
    longest = [seconds for _, seconds in report["slowest_compiles"]]
    assert len(longest) == 3 and longest == sorted(longest, reverse=True)
    assert sum(report["compile_thread_seconds_by_kind"].values()) >= longest[0]
    # when each kind's last compile ended: within the warm-up, the last of them near its end
    done = report["compiles_done_by_kind"]
    assert done.keys() == by_kind.keys() and 0 < min(done.values())
    assert max(done.values()) <= report["compile_seconds"] + 0.01
    assert len(runner.programs.compile_seconds) == report["compiled"] - report["loaded_from_cache"]
    assert min(runner.programs.compile_seconds.values()) > 0  # unrounded: a fast machine rounds a compile to 0.00
    # once before compiling (what was ready already), then once per program compiled, up to all of them
    total = report["programs"]
    assert heard == [(total - report["compiled"] + i, total) for i in range(report["compiled"] + 1)]
    prompts = [list(range(3, 3 + n)) for n in (5, 30, 61, 12)]
    drive(runner, prompts, 12, params=MIXED, chunk=13, stagger=2, preempt={6: [1], 9: [2, 3]})
    drive(runner, prompts[:2], 6)
    assert runner.programs.asked <= runner.programs.warm and runner.programs.compiled_on_use == 0


def test_each_step_program_runs_once_before_serving_and_leaves_nothing_behind(monkeypatch):
    """A program's first run on a GPU holds the host far longer than its later runs (its kernels
    load), so after warm-up each step program runs once on warm-up's synthetic schedules
    (`Runner.run_each_once`): every backbone, sampler, decode loop and row write that warm-up
    compiled ran, and nothing they wrote stays: the state is a fresh one, and sampled tokens
    (unseeded ones too) are those of a runner that ran nothing before. One request bucket: each kind
    of program is there, at half the compiles."""
    cfg, params = load_model(MODEL.parent / "tiny-llama", "float32")
    config = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=96, block_size=8, num_blocks=48,
                          num_scheduler_steps=4, seed=3, request_buckets=(4,))
    runner = Runner(cfg, params, config)
    runner.warmup()
    calls, run = [], runner.programs.run
    monkeypatch.setattr(runner.programs, "run", lambda kind, **named: calls.append(runner.programs.program(kind, **named).key)
                        or run(kind, **named))
    state = runner.run_each_once(runner.init_state())
    steps = {p.key for p in runner.programs.warmup_programs() if p.kind.name != "prompt_logprobs"}
    assert set(calls) == steps and {key[0] for key in steps} == {"forward", "sample", "decode_loop", "write_blocks",
                                                                  "write_tokens"}
    fresh = runner.init_state()
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(fresh)))
    prompts = [list(range(3, 3 + n)) for n in (5, 30, 12)]
    sampling = [SamplingParams(temperature=1.0), *MIXED[1:3]]
    assert drive(runner, prompts, 10, params=sampling, chunk=13) == drive(Runner(cfg, params, config), prompts, 10,
                                                                            params=sampling, chunk=13)
    with pytest.raises(RuntimeError, match="before the first step"):  # it would drop a request's rows
        runner.run_each_once(runner.step(state, SchedulerOutput(
            [NewRequestData("r", [3, 4, 5], ([0],), 0, SamplingParams())], num_scheduled_tokens={"r": 3},
            total_num_scheduled_tokens=3))[0])


def test_a_gpu_start_runs_each_program_once_unless_it_compiled_none(tmp_path, monkeypatch, fresh_jax_cache):
    """After a warm-up that compiled programs, a GPU start runs each once before serving; one that
    found them all in the program cache serves without (their first runs would cost it more than
    they spare the first steps), as does one whose programs a runner before it made."""
    monkeypatch.setenv("JAXRUNNER_CACHE", str(tmp_path))
    monkeypatch.setattr(programs_table, "_shared", weakref.WeakValueDictionary())
    ran = []
    monkeypatch.setattr(Runner, "run_each_once", lambda self, state: ran.append(self) or state)
    args = EngineArgs("tiny", load_format="dummy", skip_tokenizer_init=True, max_model_len=32, max_num_seqs=2,
                      max_num_batched_tokens=16, enforce_eager=False)
    starts = []
    for fresh_process in (True, True, False):
        if fresh_process:  # no runner alive shares its programs
            monkeypatch.setattr(programs_table, "_shared", weakref.WeakValueDictionary())
        engine = LLMEngine(args, defer_warm_up=True)
        with monkeypatch.context() as gpu:
            gpu.setattr(platform, "on_gpu", lambda: True)
            engine.warm_up()
        report = engine.startup
        starts.append((report["compiled"] - report["loaded_from_cache"], report["loaded_from_cache"], len(ran)))
    total = report["programs"]
    assert starts == [(total, 0, 1), (0, total, 1), (0, 0, 1)]


def test_a_background_warm_up_steps_with_the_buckets_ready_and_never_compiles_on_a_step(monkeypatch):
    """`warmup(background=True)` compiles the largest buckets' programs, and steps pad up to them
    while a thread compiles the rest (held back here until the first workload ran); then the
    smaller buckets serve, the same tokens come out, and no step compiled anything. The token
    buckets tell it: one request bucket."""
    cfg, params = load_model(MODEL.parent / "tiny-llama", "float32")
    config = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=96, block_size=8, num_blocks=72,
                          request_buckets=(4,))
    runner = Runner(cfg, params, config)
    release, warm_up = threading.Event(), runner.programs.warm_up

    def held_back(*args, **kwargs):
        if threading.current_thread().name == "jaxrunner-warm-up":
            release.wait(300)
        return warm_up(*args, **kwargs)

    monkeypatch.setattr(runner.programs, "warm_up", held_back)
    report = runner.warmup(background=True)
    assert 0 < report["in_background"] < report["programs"]
    prompts = [list(range(3, 3 + n)) for n in (5, 30, 12)]
    first = drive(runner, prompts, 10, chunk=13)
    buckets = {key[1] for key in runner.programs.asked if key[0] == "forward"}
    assert buckets == {config.max_num_batched_tokens}  # only the largest token bucket was ready
    release.set()
    runner.join_warmup(300)
    assert drive(runner, prompts, 10, chunk=13) == first
    assert min(key[1] for key in runner.programs.asked if key[0] == "forward") < config.max_num_batched_tokens
    assert runner.programs.asked <= runner.programs.warm and runner.programs.compiled_on_use == 0


def test_closing_the_engine_ends_a_background_warm_up(monkeypatch):
    """close() (also run when the engine is dropped or the interpreter exits) ends a background
    warm-up once the compiles it started are done, and waits for them: a compile still running at
    the interpreter's exit aborts the process. Compiles are slowed here so that it is mid-way."""
    compile_one = Programs._compile

    def slow(self, *args):
        time.sleep(0.3)
        return compile_one(self, *args)

    monkeypatch.setattr(Programs, "_compile", slow)
    llm = LLM(str(MODEL), skip_tokenizer_init=True, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=96,
              block_size=8, num_gpu_blocks_override=24, enforce_eager=False, compile_in_background=True)
    programs = llm.llm_engine.runner.programs
    llm.close()
    assert "jaxrunner-warm-up" not in {thread.name for thread in threading.enumerate()}
    assert len(programs.warm) < len(programs.warmup_programs())


def test_the_gpu_default_warms_up_a_sampler_per_variant_for_each_power_of_four():
    """Start-up's program count at the engine's GPU sizes (256 sequences, 8192 tokens): request
    buckets of powers of four from 16 (the token buckets' floor), 12 sampler variants each, one
    forward per token bucket and one more for each decode bucket; listing the programs lowers nothing."""
    model, params = load_model(MODEL)
    config = RunnerConfig(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=1024, num_blocks=64,
                          kernels="pallas")
    assert config.request_buckets == (16, 64, 256)
    kinds = [p.kind.name for p in Runner(model, params, config).programs.warmup_programs()]
    assert kinds.count("sample") == 12 * 3
    assert kinds.count("forward") == 10 + 5  # 16 .. 8192 tokens; decodes of 16 .. 256
    assert kinds.count("write_blocks") == kinds.count("write_tokens") == 3  # a request bucket's rows each
    assert len(kinds) == 67


def test_a_step_lowers_its_layer_once_for_all_layers():
    # Lowering each layer (on a GPU, its Pallas kernels into Triton) was most of start-up.
    model = dataclasses.replace(shape("tiny"), num_layers=4)
    config = RunnerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, num_blocks=64)
    runner = Runner(model, init_params(model, jax.random.key(0)), config)
    program = runner.programs.program(programs_table.FORWARD, params=runner.params, draft_params=runner.draft_params,
                                      lora=runner.lora, state=runner.init_state(), tokens=runner.ctx.tokens(16),
                                      uniform_decode=False)
    text = program.kind.jitted.lower(*program.args, **program.statics).as_text()
    assert len(re.findall(r"func\.func private @decoder_layer\b", text)) == 1
    assert len(re.findall(r"call @decoder_layer\b", text)) == 4


def _runner_and_programs() -> tuple[Runner, list]:
    cfg, params = load_model(MODEL, "float32")
    runner = Runner(cfg, params, RunnerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=48, block_size=8, num_blocks=16))
    return runner, runner.programs.warmup_programs()


def test_without_warm_up_a_steps_new_programs_compile_together(monkeypatch):
    """Without a warm-up, each step's programs not made yet are made in one `compile_all` (in
    parallel) before the step runs them, none alone as the step first calls it: the first step's
    row writes, forward, sampler and prompt scoring together. The tokens are a warmed-up runner's."""
    runner, _ = _runner_and_programs()
    prompts = [list(range(3, 3 + n)) for n in (5, 11)]
    params = [SamplingParams(temperature=0.0, prompt_logprobs=1), SamplingParams(temperature=0.8, top_k=5, seed=1)]
    runner.programs = Programs(runner.ctx)
    runner.warmup()
    warmed = drive(runner, prompts, 5, params=params)
    runner.programs = fresh = Programs(runner.ctx)
    ahead, every, compile_for_step, compile_all = [], [], fresh.compile_for_step, fresh.compile_all
    monkeypatch.setattr(fresh, "compile_for_step", lambda programs: ahead.append(
        [p.key[0] for p in programs if p.key not in fresh._compiled]) or compile_for_step(programs))
    monkeypatch.setattr(fresh, "compile_all", lambda programs, **kw: every.append(len(programs)) or compile_all(programs, **kw))
    assert drive(runner, prompts, 5, params=params) == warmed
    made = [kinds for kinds in ahead if kinds]
    assert {"write_blocks", "forward", "sample", "prompt_logprobs"} <= set(made[0])
    assert every == [len(kinds) for kinds in made] and fresh.compiled_on_use == sum(every) == len(fresh._compiled)
    assert set(fresh._compiled) == fresh.asked  # none made that the steps did not call


def test_without_warm_up_a_multi_step_decodes_loop_compiles_before_it_runs(monkeypatch):
    """The same through the engine with multi-step decode: each step's new programs, a decode's
    loop among them, are made in `compile_for_step`, only those the steps call."""
    made, compile_for_step = [], Programs.compile_for_step
    monkeypatch.setattr(Programs, "compile_for_step", lambda self, programs: made.append(
        [p.key[0] for p in programs if p.key not in self._compiled]) or compile_for_step(self, programs))
    llm = LLM(TINY_MODEL, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=48, block_size=8,
              num_gpu_blocks_override=16, num_scheduler_steps=4, enforce_eager=True)
    programs = llm.llm_engine.runner.programs
    before, on_use = set(programs._compiled), programs.compiled_on_use
    outs = llm.generate(["Hello there", "Once upon a time"], SamplingParams(temperature=0.0, max_tokens=9), use_tqdm=False)
    assert all(o.finished for o in outs) and any("decode_loop" in kinds for kinds in made)
    assert set(programs._compiled) - before == programs.asked - before
    assert programs.compiled_on_use - on_use == sum(map(len, made))  # none compiled alone as a step called it


def test_a_samplers_program_is_the_same_whatever_the_kv_cache_size():
    """The sampler takes the state's token rows, not its KV pages: its program-cache key does not
    change with the cache's size (KV sizing's sampler is then the sized runner's, and another
    gpu_memory_utilization finds every sampler cached), where a backbone's does."""
    runner, _ = _runner_and_programs()
    other = Runner(runner.model_config, runner.params, dataclasses.replace(runner.config, num_blocks=24))
    cache = ProgramCache("unused")

    def keys(r: Runner, kind: str) -> set[str]:
        return {cache.key(p.kind.jitted, p.key, p.args, p.statics) for p in r.programs.warmup_programs()
                if p.kind.name == kind}

    assert keys(runner, "sample") == keys(other, "sample") and len(keys(runner, "sample")) == 12
    assert keys(runner, "forward").isdisjoint(keys(other, "forward"))


def test_the_weights_compile_into_the_persistent_cache(monkeypatch, tmp_path, fresh_jax_cache):
    """Random weights' draws (and quantizing) compile programs of their own before any runner is
    made: JAX's persistent cache is on by then, so a warm start finds them too."""
    monkeypatch.setenv("JAXRUNNER_CACHE", str(tmp_path))
    seen, load = [], engine_module.load_weights
    monkeypatch.setattr(engine_module, "load_weights",
                        lambda *a: seen.append(jax.config.jax_compilation_cache_dir) or load(*a))
    LLM("tiny", load_format="dummy", skip_tokenizer_init=True, max_model_len=64)
    assert seen == [str(tmp_path / "xla")]
    assert any(f.name.startswith("jit__draw") for f in (tmp_path / "xla").iterdir())


def test_program_cache_loads_every_program_without_lowering_and_runs_the_same(tmp_path, fresh_jax_cache):
    runner, programs = _runner_and_programs()
    stored = Programs(runner.ctx, ProgramCache(tmp_path))
    stored.compile_all(programs)
    assert len(list(tmp_path.glob("*.jaxexe"))) == len(programs) and stored.loaded == 0

    prompts = [list(range(3, 3 + n)) for n in (5, 19)]
    params = [SamplingParams(temperature=0.0, logprobs=2, prompt_logprobs=1), SamplingParams(temperature=0.8, top_k=5, seed=1)]
    runs = []
    for fresh in (Programs(runner.ctx, ProgramCache(tmp_path)), Programs(runner.ctx)):
        runner.programs = fresh
        report = runner.warmup()
        assert report["compiled"] == len(programs)
        runs.append((report["loaded_from_cache"], report["lowering_seconds"] > 0, drive(runner, prompts, 6, params=params, chunk=7)))
        assert fresh.compiled_on_use == 0
    assert runs[0][:2] == (len(programs), False) and runs[1][:2] == (0, True)
    assert runs[0][2] == runs[1][2]


def test_a_program_compiled_on_use_is_kept_in_the_program_cache_and_loaded_the_next_time(tmp_path, fresh_jax_cache):
    """Without a warm-up (`enforce_eager`, as `jaxrunner generate` starts) a step compiles each
    program as it first runs it, into the program cache as warm-up does: the next start loads the
    same programs without lowering them, and runs the same."""
    runner, _ = _runner_and_programs()
    runs = []
    for _ in range(2):
        jax.clear_caches()
        runner.programs = fresh = Programs(runner.ctx, ProgramCache(tmp_path))
        tokens = drive(runner, [list(range(3, 8)), list(range(5, 13))], 4)
        runs.append((fresh.compiled_on_use, fresh.loaded, fresh.lowering_seconds > 0, tokens))
    (compiled, none_loaded, lowered, first), (again, loaded, lowered_again, second) = runs
    assert compiled > 0 and none_loaded == 0 and lowered
    assert again == loaded == compiled and not lowered_again
    assert len(list(tmp_path.glob("*.jaxexe"))) == compiled and first == second


def test_programs_jax_loaded_from_its_cache_are_not_stored(tmp_path, fresh_jax_cache):
    """An executable JAX loaded from its persistent cache, handed back again from memory for the same
    lowering, is not stored: on the CPU such a file loads but cannot run ("Function ... not found").
    What is stored is XLA's own compile, and runs."""
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "xla"))
    runner, programs = _runner_and_programs()
    programs = [p for p in programs if p.kind.name in ("write_blocks", "sample")][:3]
    Programs(runner.ctx).compile_all(programs)  # XLA compiles them; JAX stores them in its cache
    jax.clear_caches()
    Programs(runner.ctx).compile_all(programs)  # JAX loads them from its cache
    store = ProgramCache(tmp_path / "programs")
    Programs(runner.ctx, store).compile_all(programs)  # JAX hands back what it loaded
    assert not list(tmp_path.rglob("*.jaxexe"))
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "empty"))
    compilation_cache.reset_cache()
    jax.clear_caches()
    Programs(runner.ctx, store).compile_all(programs)  # XLA compiles them
    loaded = Programs(runner.ctx, store)
    loaded.compile_all(programs)
    assert loaded.loaded == len(programs) == len(list(tmp_path.rglob("*.jaxexe")))
    for program in programs:  # on fresh buffers: the programs donate theirs
        args = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), program.args)
        jax.block_until_ready(loaded.executable(program)(*args))


def test_program_cache_keys_follow_the_sources(monkeypatch):
    """A program compiled from other code is another program: the key hashes every source the
    lowering is made from (the runner's and the kernels'), so an upgrade never loads a stale one."""
    names = {path.relative_to(program_cache.PACKAGES).as_posix() for path in program_cache.source_files()}
    assert {"jaxrunner/runner/step.py", "jaxrunner/models/llama.py", "pallas_kernels/attention_kernel.py"} <= names
    runner, programs = _runner_and_programs()
    program, cache = programs[0], ProgramCache("unused")
    key = cache.key(program.kind.jitted, program.key, program.args, program.statics)
    monkeypatch.setattr(program_cache, "_source_digest", lambda: "other sources")
    assert cache.key(program.kind.jitted, program.key, program.args, program.statics) != key


def test_program_cache_keys_are_the_same_in_another_process(tmp_path):
    # A key must not depend on object ids or hash seeds, or a new process never finds its programs.
    script = (
        "import json, sys; sys.path[:0] = %r; from test_warmup import _runner_and_programs; "
        "from jaxrunner.runner.program_cache import ProgramCache; cache = ProgramCache('unused'); runner, programs = _runner_and_programs(); "
        "print(json.dumps([cache.key(p.kind.jitted, p.key, p.args, p.statics) for p in programs]))"
    ) % [str(Path(__file__).parent), str(Path(__file__).parents[1])]
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env={**os.environ, "PYTHONHASHSEED": "7"})
    cache = ProgramCache(tmp_path)
    _, programs = _runner_and_programs()
    keys = [cache.key(p.kind.jitted, p.key, p.args, p.statics) for p in programs]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == keys and len(set(keys)) == len(keys)


def test_a_cached_program_that_does_not_load_is_compiled_again_and_rewritten(tmp_path, fresh_jax_cache, caplog):
    runner, programs = _runner_and_programs()
    program = programs[-1]
    Programs(runner.ctx, ProgramCache(tmp_path)).compile_all([program])
    [path] = tmp_path.glob("*.jaxexe")
    path.write_bytes(path.read_bytes()[:100])
    jax.clear_caches()  # as a new process: XLA compiles it again
    runs = [Programs(runner.ctx, ProgramCache(tmp_path)) for _ in range(2)]
    for programs in runs:
        programs.compile_all([program])
    assert [p.loaded for p in runs] == [0, 1] and "cannot load the cached program" in caplog.text


def test_a_program_whose_matmuls_another_makes_is_compiled_after_it():
    """XLA autotunes a fusion once per process: `tuning_order` puts a program all of whose matmuls
    (`Kind.gemms`) an earlier one makes behind the first program making each, at the engine's GPU
    sizes: a forward's decode form behind its general form, a row bucket's later samplers behind the
    first program with that LM head, the prompt-logprobs programs (chunks of 256 rows each) behind
    the first with a 256-row head; and nothing with a matmul of its own waits."""
    model, params = load_model(MODEL)
    config = RunnerConfig(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=1024, num_blocks=64,
                          kernels="pallas", num_scheduler_steps=8)
    programs = Runner(model, params, config).programs.warmup_programs()
    behind = programs_table.tuning_order(programs)
    order = {p.key: i for i, p in enumerate(programs)}
    gemms_of = {p.key: set(p.kind.gemms(p.key[1:])) for p in programs}
    made_before: set = set()
    for p in programs:
        gemms = gemms_of[p.key]
        if p.key in behind:
            assert all(order[k] < order[p.key] for k in behind[p.key])
            assert gemms <= set().union(*(gemms_of[k] for k in behind[p.key]))
        else:
            assert not gemms or not gemms <= made_before, p.key
        made_before |= gemms
    for t in (16, 64, 256):
        assert behind[("forward", t, True)] == {("forward", t, False)}
    samplers = [p.key for p in programs if p.kind.name == "sample" and p.key[1] == 16]
    assert len(samplers) == 12 and all(behind[k] == behind[samplers[1]] for k in samplers[1:])
    logprobs = [p.key for p in programs if p.kind.name == "prompt_logprobs"]
    assert len(logprobs) == 10 and all(behind[k] == behind[logprobs[0]] for k in logprobs)
    assert not any(p.kind.name in ("write_blocks", "write_tokens", "spec_sample") for p in programs if p.key in behind)


def test_compile_all_holds_a_program_until_those_it_is_behind_are_compiled(monkeypatch):
    """With stand-in compiles: the programs `tuning_order` holds start once those they wait for have
    ended, and all the others start at once (they meet at a barrier, which a one-by-one pool breaks)."""
    runner, programs = _runner_and_programs()
    behind = programs_table.tuning_order(programs)
    assert behind  # the later sampler variants wait for the first
    free = threading.Barrier(len(programs) - len(behind), timeout=30)
    spans: dict = {}

    def stand_in(self, key, lowered, cache_key):
        start = time.perf_counter()
        if key not in behind:
            free.wait()
        time.sleep(0.05)
        spans[key] = (start, time.perf_counter())
        return object()

    monkeypatch.setattr(Programs, "_lower", lambda self, program: None)
    monkeypatch.setattr(Programs, "_compile", stand_in)
    assert Programs(runner.ctx).compile_all(programs, workers=len(programs)) == len(programs) == len(spans)
    for key, waits_for in behind.items():
        assert all(spans[key][0] >= spans[k][1] for k in waits_for), key
