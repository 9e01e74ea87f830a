"""KV cache sizing: the largest step's activation memory, measured from its compiled executables,
the blocks that fit beside it and the weights, and the GPU memory pool they fit in."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import threading
import weakref

import pytest
from jax._src import xla_bridge

from jaxrunner import LLM, Runner, RunnerConfig, SamplingParams, platform
from jaxrunner.checkpoints.dummy import random_params, shape
from jaxrunner.engine import engine as engine_module
from jaxrunner.engine import engine_args as engine_args_module
from jaxrunner.engine.default_model import default_model
from jaxrunner.engine.engine_args import KV_BLOCKS_JITTER, EngineArgs, blocks_as_before, host_tier_bytes, kv_blocks_that_fit
from jaxrunner.engine.host_tier import max_loads
from jaxrunner.runner import programs as programs_module
from jaxrunner.runner.program_cache import ProgramCache
from jaxrunner.runner.programs import DECODE_LOOP, KV_FREE_KINDS


def test_peak_step_bytes_grows_with_the_largest_bucket():
    cfg, params = default_model()
    small = RunnerConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64, num_blocks=1)
    peaks = [
        Runner(cfg, params, dataclasses.replace(small, max_num_batched_tokens=n, token_buckets=())).peak_step_bytes()
        for n in (32, 512)
    ]
    assert 0 < peaks[0] < peaks[1]


def test_the_reservation_covers_the_multi_step_decode_loop():
    """A loop of decode steps holds a backbone's temporaries and a sampler's at once: more than the
    largest backbone here, which is all the reservation held before."""
    cfg = dataclasses.replace(shape("tiny"), num_layers=4, hidden_size=256, intermediate_size=4096, head_dim=64)
    config = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, num_blocks=1,
                          dtype="bfloat16", token_buckets=(), num_scheduler_steps=4)
    runner = Runner(cfg, random_params(cfg, "bfloat16", 0), config)
    loop = runner.programs.executable(runner.programs.examples(DECODE_LOOP)[0]).memory_analysis().temp_size_in_bytes
    forward = runner.compile_forward(16).memory_analysis().temp_size_in_bytes
    assert loop > forward
    assert runner.peak_step_bytes() >= loop


def test_a_start_reads_the_step_peak_an_earlier_start_measured(tmp_path, monkeypatch):
    """With a program cache the figure is kept: the next start (a fresh program table) reads it
    without compiling or loading the programs it came from; another configuration measures anew."""
    cfg, params = default_model()
    config = RunnerConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64, num_blocks=1,
                          token_buckets=(), compilation_cache_dir=str(tmp_path))
    measured = Runner(cfg, params, config).peak_step_bytes()
    monkeypatch.setattr(programs_module, "_shared", weakref.WeakValueDictionary())  # as in a new process
    runner = Runner(cfg, params, config)
    monkeypatch.setattr(programs_module.Programs, "compile_all", lambda *a, **k: pytest.fail("compiled or loaded"))
    assert runner.peak_step_bytes() == measured > 0
    monkeypatch.undo()
    wider = Runner(cfg, params, dataclasses.replace(config, max_num_batched_tokens=512, token_buckets=()))
    assert wider.peak_step_bytes() > measured and wider.programs.compile_seconds


def test_a_device_sizes_the_cache_beside_the_weights_and_the_measured_step(monkeypatch):
    """Where the allocator gives figures (faked here on the CPU), the blocks are those that fit in
    `gpu_memory_utilization` of the device beside the bytes in use and the largest step, measured
    once from the model's config and the sizing configuration: no params are needed for it."""
    measured, measure = [], engine_args_module.largest_step_bytes

    def measuring(ctx, warming_up):
        assert not warming_up  # no warm-up follows: nothing compiles beside the sizing
        measured.append((ctx.config.num_blocks, measure(ctx, warming_up)))
        return measured[-1][1]

    gib = 2**30
    monkeypatch.setattr(engine_args_module, "largest_step_bytes", measuring)
    monkeypatch.setattr(platform, "memory_stats", lambda device=0: {"bytes_limit": gib, "bytes_in_use": gib // 4})
    engine = LLM("tiny", load_format="dummy", skip_tokenizer_init=True, max_model_len=64, max_num_seqs=2,
                 max_num_batched_tokens=32, enforce_eager=True).llm_engine
    [(blocks, activations)] = measured
    assert blocks == 1 and activations > 0
    per_block = engine_args_module.bytes_per_block(engine.model_config, engine.config)
    fit = kv_blocks_that_fit(gib, gib // 4, activations, 0.9, per_block)
    blocks = engine.config.num_blocks
    assert fit - fit // KV_BLOCKS_JITTER <= blocks <= fit  # a little under, or an earlier start's
    # The next starts find a little less, or a little more, in use: they take the same blocks, and
    # so the same programs.
    sizing = dataclasses.replace(engine.config, num_blocks=1, num_host_blocks=0)
    for in_use in (gib // 4 + per_block, gib // 4 - 2 * per_block):
        monkeypatch.setattr(platform, "memory_stats", lambda device=0: {"bytes_limit": gib, "bytes_in_use": in_use})
        assert kv_blocks_that_fit(gib, in_use, activations, 0.9, per_block) != fit
        assert engine_args_module._num_blocks(engine.args, engine.model_config, sizing, None) == blocks


def test_sizing_compiles_the_programs_without_kv_pages_for_the_warm_up(tmp_path, monkeypatch, fresh_jax_cache):
    """A start that warms up compiles the programs whose shapes the cache's size leaves alone (the
    samplers, prompt scoring) beside the sizing's own, and warm-up takes them: it compiles only the
    programs that hold the KV cache. They pass in memory, not through the program cache's files:
    nothing is stored here, as when JAX's own persistent cache gave every executable back."""
    monkeypatch.setenv("JAXRUNNER_CACHE", str(tmp_path))
    monkeypatch.setattr(programs_module, "_shared", weakref.WeakValueDictionary())
    monkeypatch.setattr(ProgramCache, "store", lambda *args: None)
    monkeypatch.setattr(programs_module, "_sized_alongside", {})
    gib = 2**30
    monkeypatch.setattr(platform, "memory_stats", lambda device=0: {"bytes_limit": gib, "bytes_in_use": gib // 4})
    llm = LLM("tiny", load_format="dummy", skip_tokenizer_init=True, max_model_len=32, max_num_seqs=2,
              max_num_batched_tokens=16, enforce_eager=False)
    engine, programs = llm.llm_engine, llm.llm_engine.runner.programs
    kv_free = {p.key for p in programs.warmup_programs() if p.kind in KV_FREE_KINDS}
    assert {key[0] for key in kv_free} == {"sample", "prompt_logprobs"}
    compiled_here = programs.compile_seconds.keys()
    assert compiled_here and not kv_free & compiled_here
    assert engine.startup["loaded_from_cache"] == len(kv_free) == engine.startup["programs"] - len(compiled_here)
    assert {key[0] for key in compiled_here} == {"forward", "write_blocks", "write_tokens"}
    assert not programs_module._sized_alongside  # all taken
    # and they run on the runner's buffers: a sampler and prompt scoring, nothing compiled on use
    programs.asked.clear()
    out = llm.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(max_tokens=4, prompt_logprobs=1, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4 and out.prompt_logprobs
    assert {key[0] for key in programs.asked} >= {"sample", "prompt_logprobs"} and programs.compiled_on_use == 0


def test_a_start_sized_as_before_reads_its_programs_while_its_weights_load(tmp_path, monkeypatch, fresh_jax_cache,
                                                                           caplog):
    """Where an earlier start of the same sizing kept its figures (the largest step's bytes, the
    blocks it took), the runner a start will make is known before its weights load: its programs
    are read from the program cache meanwhile, off the main thread, and its warm-up finds every
    one made. A first start (no figures yet) reads none ahead; one whose weights left another room
    than the guess assumed sizes otherwise, and its warm-up makes its own programs."""
    monkeypatch.setenv("JAXRUNNER_CACHE", str(tmp_path))
    caplog.set_level(logging.INFO, logger="jaxrunner.engine.engine")
    gib, in_use = 2**30, [2**28]
    monkeypatch.setattr(platform, "memory_stats", lambda device=0: {"bytes_limit": gib, "bytes_in_use": in_use[0]})
    loading, first_read, read_while_loading = threading.Event(), threading.Event(), []
    load_weights, read = engine_module.load_weights, ProgramCache.load

    def reading(cache, key):
        if loading.is_set():
            read_while_loading.append(threading.current_thread() is not threading.main_thread())
            first_read.set()
        return read(cache, key)

    def loading_weights(*args):
        loading.set()
        first_read.wait(timeout=60 if len(starts) == 1 else 0)  # the second start's loading waits for a read
        weights = load_weights(*args)
        loading.clear()
        return weights

    monkeypatch.setattr(ProgramCache, "load", reading)
    monkeypatch.setattr(engine_module, "load_weights", loading_weights)
    starts = []
    for room_taken in (0, 0, 2**27):
        in_use[0] += room_taken
        read_while_loading.clear()
        monkeypatch.setattr(programs_module, "_shared", weakref.WeakValueDictionary())  # a process of its own
        engine = LLM("tiny", load_format="dummy", skip_tokenizer_init=True, max_model_len=32, max_num_seqs=2,
                     max_num_batched_tokens=16, enforce_eager=False).llm_engine
        report = engine.startup
        starts.append((engine.config.num_blocks, report["loaded_ahead"], report["compiled"] - report["loaded_from_cache"],
                       len(read_while_loading), all(read_while_loading)))
    total = report["programs"]
    (blocks, none_ahead, _, none_read, _), (same_blocks, ahead, compiled, read_ahead, off_main), guessed_wrong = starts
    assert same_blocks == blocks and none_ahead == 0 and none_read == 0
    assert ahead == total and compiled == 0 and read_ahead and off_main
    fewer_blocks, none_ahead, compiled, _, _ = guessed_wrong  # it read the guess's programs, and drops them
    assert fewer_blocks < blocks and none_ahead == 0 and compiled > 0
    assert "the programs read ahead were for a KV cache" in caplog.text


def test_a_start_takes_the_blocks_an_earlier_start_took_while_they_fit(tmp_path):
    """The bytes in use after loading differ a little between starts, and the block count is in
    every program's shapes: a start takes 1/1024 under what fits, and a later start takes that count
    where it fits and leaves at most 2/1024 of its fit unused; otherwise a new count, which the
    next start then takes."""
    cfg = RunnerConfig(num_blocks=1, compilation_cache_dir=str(tmp_path))
    sizing = ("a model", cfg, 2**30)
    assert KV_BLOCKS_JITTER == 1024
    assert blocks_as_before(cfg, sizing, 102400) == 102300
    assert blocks_as_before(cfg, sizing, 102350) == 102300  # a little less room
    assert blocks_as_before(cfg, sizing, 102500) == 102300  # a little more
    assert blocks_as_before(cfg, sizing, 102299) == 102200  # less: the earlier count does not fit
    assert blocks_as_before(cfg, sizing, 102400) == 102200
    assert blocks_as_before(cfg, sizing, 102700) == 102600  # more than 2/1024 would be left unused
    assert blocks_as_before(cfg, ("another model", cfg, 2**30), 102400) == 102300
    assert blocks_as_before(dataclasses.replace(cfg, compilation_cache_dir=None), sizing, 102400) == 102400


def test_blocks_fit_beside_the_weights_and_the_step():
    gib = 2**30
    assert kv_blocks_that_fit(100 * gib, 16 * gib, 2 * gib, 0.9, gib // 8) == 8 * (90 - 16 - 2)
    with pytest.raises(ValueError, match="no room for a KV cache.*raise gpu_memory_utilization"):
        kv_blocks_that_fit(100 * gib, 60 * gib, 31 * gib, 0.9, gib)


def test_a_host_tier_sets_aside_device_memory_for_its_copies():
    """With a host tier, sizing keeps room for the blocks loading at once, as many evicted for them,
    and a step's own evictions (the gathers its saves copy from); without one, nothing."""
    cfg = RunnerConfig(max_num_seqs=256, max_num_batched_tokens=8192, block_size=16, num_blocks=1)
    per_block = 2 << 20  # a block of Llama-3-8B's shape in bf16
    assert host_tier_bytes(EngineArgs(), cfg, per_block) == 0
    assert max_loads(per_block) == 1024 + 64  # 16k tokens, and two pieces of 64 MB
    assert host_tier_bytes(EngineArgs(kv_offloading_size=8), cfg, per_block) == (2 * 1088 + 512 + 256) * per_block
    assert max_loads(1 << 40) == 1  # a block larger than the bound still loads


def test_the_engine_gives_jaxs_gpu_pool_most_of_the_device_unless_told(monkeypatch):
    """JAX's allocator takes 75% of a GPU by default: the engine asks for GPU_POOL_FRACTION before it
    starts JAX's backend (checked in a fresh process: the suite's backend is long started), and
    leaves a fraction the user set, or a started backend's, as it is. The same process shows XLA
    taking the engine's GEMM autotuning flag (an unknown one would abort it), and one the user set
    in XLA_FLAGS stands."""
    script = ("import os; from jaxrunner.engine.engine import LLMEngine; from jaxrunner.engine.engine_args import EngineArgs; "
              "LLMEngine(EngineArgs(model='jaxrunner-tiny-random', enforce_eager=True)); "
              "print(os.environ['XLA_FLAGS']); print(os.environ['XLA_CLIENT_MEM_FRACTION'])")
    env = {k: v for k, v in os.environ.items() if k not in (*platform.POOL_VARIABLES, "XLA_FLAGS")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    *_, flags, fraction = done.stdout.splitlines()
    assert float(fraction) == platform.GPU_POOL_FRACTION == 0.95
    assert flags == f"{platform.GEMM_TILINGS_FLAG}=top={platform.GEMM_TILINGS_TIMED}"
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    monkeypatch.setenv("XLA_FLAGS", f"--xla_dump_to=/tmp/x {platform.GEMM_TILINGS_FLAG}=top=2")
    platform.limit_gemm_autotuning()
    assert os.environ["XLA_FLAGS"] == f"--xla_dump_to=/tmp/x {platform.GEMM_TILINGS_FLAG}=top=2"
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    platform.limit_gemm_autotuning()
    assert os.environ["XLA_FLAGS"] == f"--xla_dump_to=/tmp/x {platform.GEMM_TILINGS_FLAG}=top=8"
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION", raising=False)
    platform.claim_gpu_memory()
    assert "XLA_CLIENT_MEM_FRACTION" not in os.environ  # with the other set, JAX would refuse to start
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: True)
    platform.claim_gpu_memory()
    assert "XLA_CLIENT_MEM_FRACTION" not in os.environ
