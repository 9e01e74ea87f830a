"""The prefix cache's host tier: KV blocks evicted from the device are kept in host memory and copied
back when a prefix comes back (the scheduler's side is in test_scheduler, with a fake runner)."""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxrunner import LLM, Runner, RunnerConfig, SamplingParams, SchedulerOutput
from jaxrunner.checkpoints.loader import load_model
from jaxrunner.engine import EngineArgs
from jaxrunner.step_io import KVTransfers

DATA = Path(__file__).parent / "data"


def pages(state) -> list[np.ndarray]:
    return [np.asarray(leaf).astype(np.float32) for leaf in jax.tree.leaves((state.kv, state.draft_kv))]


def random_state(runner: Runner, seed: int):
    """The runner's first state with random pages, so that every block's are its own."""
    state = runner.init_state()
    keys = iter(jax.random.split(jax.random.key(seed), 64))
    return dataclasses.replace(state, kv=jax.tree.map(
        lambda x: jax.device_put(jax.random.normal(next(keys), x.shape).astype(x.dtype), x.sharding), state.kv))


def recorded_programs(monkeypatch, runner: Runner) -> list[tuple]:
    """The keys of the programs the runner runs from now on, in order."""
    calls, programs = [], runner.programs
    monkeypatch.setattr(programs, "run", lambda kind, **named: calls.append(programs.program(kind, **named).key)
                        or type(programs).run(programs, kind, **named))
    return calls


COPY_PROGRAMS = ("gather_blocks", "stack_pieces", "scatter_blocks")


def transfer(runner: Runner, state, transfers: KVTransfers):
    """A step of the runner that only moves blocks."""
    return runner.sample_tokens(runner.execute_model(state, SchedulerOutput(kv_transfers=transfers)))[0]


@pytest.mark.parametrize("tp, kv_cache_dtype", [(1, "auto"), (2, "fp8")])
def test_saved_blocks_come_back_bitwise_one_step_after_their_load(tp, kv_cache_dtype):
    """The runner's copies alone, on random pages: blocks saved to host slots and loaded into other
    blocks arrive bitwise in every page (each layer's K and V, split over the devices under TP), in
    the first step after their copies arrived, and nothing else changes. A step's saves are pieces
    of a copy bucket's size (three blocks: two and one); a load moves a piece whole, starting before
    the step's programs are queued, and writes only the rows it asked for. Freed slots let their
    piece go, and a save fills them again."""
    if jax.device_count() < tp:
        pytest.skip(f"needs {tp} devices (the CPU suite forces them; a one-GPU machine has one)")
    model, params = load_model(DATA / "models" / "tiny-llama", "float32")
    cfg = RunnerConfig(max_model_len=64, block_size=4, num_blocks=16, num_host_blocks=8, tensor_parallel_size=tp,
                       kv_cache_dtype=kv_cache_dtype)
    runner = Runner(model, params, cfg)
    host = runner.host_kv
    state = random_state(runner, 0)
    before = pages(state)
    run = functools.partial(transfer, runner)

    def arrive(state, loads: int):
        deadline = time.monotonic() + 60
        while host.arrived() < loads and time.monotonic() < deadline:  # the copies run beside the steps
            time.sleep(0.01)
        return run(state, KVTransfers())

    state = run(state, KVTransfers(saves=(((3, 0), (5, 1)), ((7, 5),))))
    pieces = {slot: host.slots[slot] for slot in (0, 1, 5)}
    assert pieces[0][0] is pieces[1][0] is not pieces[5][0] and [pieces[s][1] for s in (0, 1, 5)] == [0, 1, 0]
    assert all(piece.sharding.memory_kind == "pinned_host" and piece.nbytes == n * host.block_bytes
               for piece, n in ((pieces[0][0], 2), (pieces[5][0], 1)))
    state = runner.execute_model(state, SchedulerOutput(kv_transfers=KVTransfers(loads=((0, 10), (5, 12)))))
    assert host.stats.bytes_loaded == 3 * host.block_bytes, "the loads did not start before the step's programs"
    state = runner.sample_tokens(state)[0]
    assert all(np.array_equal(a, b) for a, b in zip(pages(state), before)), "a load was written before its step"
    state = arrive(state, 1)
    state = arrive(run(state, KVTransfers(loads=((1, 11),))), 2)
    after = pages(state)
    for a, b in zip(after, before):
        assert a.shape[2] == model.num_kv_heads and np.array_equal(a[[10, 11, 12]], b[[3, 5, 7]])
        others = [i for i in range(cfg.num_blocks) if i not in (10, 11, 12)]
        assert np.array_equal(a[others], b[others]), "a row of a piece that no load asked for was written"
    assert host.stats.bytes_saved == 3 * host.block_bytes
    assert host.stats.bytes_loaded == 5 * host.block_bytes  # the two-block piece twice, the one-block once
    state = run(state, KVTransfers(frees=(0, 1, 5), saves=(((12, 1),),)))
    assert host.slots[0] is host.slots[5] is None and host.slots[1][1] == 0 and host.slots[1][0] is not pieces[1][0]
    state = arrive(run(state, KVTransfers(loads=((1, 2),))), 3)
    assert all(np.array_equal(a[2], b[7]) for a, b in zip(pages(state), before))  # block 12 held block 7's pages
    assert runner.programs.asked <= {p.key for p in runner.programs.warmup_programs()}, "warm-up misses a copy program"


def test_saves_past_a_steps_share_wait_on_the_device_where_loads_find_them(monkeypatch):
    """A step starts one piece of its saves to the host (the share monkeypatched down), oldest
    first; the others wait on the device. A load of a waiting piece reads it there (nothing moves
    over the link), a freed one is never sent, and with no device memory set aside for waiting
    saves every piece starts at once."""
    from jaxrunner.runner import host_kv

    monkeypatch.setattr(host_kv, "SAVE_BYTES_PER_STEP", 1)
    model, params = load_model(DATA / "models" / "tiny-llama", "float32")
    runner = Runner(model, params, RunnerConfig(max_model_len=64, block_size=4, num_blocks=16, num_host_blocks=8))
    host = runner.host_kv
    state = random_state(runner, 2)
    before = pages(state)
    run = functools.partial(transfer, runner)

    def kinds(*slots):
        return [host.slots[slot][0].sharding.memory_kind for slot in slots]

    state = run(state, KVTransfers(saves=(((3, 0), (5, 1)), ((7, 5),), ((9, 6),))))
    assert kinds(0, 1, 5, 6) == ["pinned_host", "pinned_host", "device", "device"]
    assert host.stats.bytes_saved == 2 * host.block_bytes
    state = run(state, KVTransfers(loads=((5, 12),), frees=(6,)))
    assert kinds(5) == ["pinned_host"] and host.slots[6] is None and host.stats.bytes_loaded == 0
    deadline = time.monotonic() + 60
    while host.arrived() < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    state = run(state, KVTransfers())
    assert all(np.array_equal(a[12], b[7]) for a, b in zip(pages(state), before))
    assert host.stats.bytes_saved == 3 * host.block_bytes, "the freed slot's piece was sent"
    monkeypatch.setattr(host, "_most_waiting", 0)
    state = run(state, KVTransfers(saves=(((1, 2),), ((2, 3),))))
    assert kinds(2, 3) == ["pinned_host", "pinned_host"]


def test_a_load_writes_its_pieces_a_group_per_program(monkeypatch):
    """With copies of at most two blocks, seven saved blocks are pieces of 2, 2, 2 and 1, gathered
    by three programs (two of the largest, the third, the last); loaded in one step, the last is
    padded to two blocks and all four are stacked and written by one program (a scatter's host
    cost is the cache's leaves, whatever its rows), bitwise, and nothing else changes. A runner of
    the same context with larger copies ran its copy programs first, and they share compiled
    programs: each pads to its own largest piece."""
    from jaxrunner.runner import context

    model, params = load_model(DATA / "models" / "tiny-llama", "float32")
    cfg = RunnerConfig(max_model_len=64, block_size=4, num_blocks=16, num_host_blocks=8)
    larger = Runner(model, params, cfg)
    larger.host_kv.run_each_once(larger.init_state())
    probe = Runner(model, params, dataclasses.replace(cfg, num_host_blocks=0))
    monkeypatch.setattr(context, "KV_TRANSFER_BYTES", 2 * probe.ctx.packed_blocks(1).size)
    runner = Runner(model, params, cfg)
    assert runner.programs is larger.programs and larger.host_kv.buckets[-1] > 2 and runner.host_kv.buckets == (1, 2)
    runner.programs.asked.clear()  # the larger runner's programs: its warm-up's, not this one's
    state = random_state(runner, 1)
    before = pages(state)
    run = functools.partial(transfer, runner)
    calls = recorded_programs(monkeypatch, runner)

    def copies():
        found = [key for key in calls if key[0] in COPY_PROGRAMS]
        calls.clear()
        return found

    saves = tuple(tuple((b, b - 1) for b in run) for run in ((1, 2), (3, 4), (5, 6), (7,)))
    state = run(state, KVTransfers(saves=saves))
    assert len({id(runner.host_kv.slots[slot][0]) for slot in range(7)}) == 4
    assert copies() == [("gather_blocks", 4, 2), ("gather_blocks", 2, 1), ("gather_blocks", 1, 1)]
    state = run(state, KVTransfers(loads=tuple((slot, slot + 8) for slot in range(7))))
    deadline = time.monotonic() + 60
    while runner.host_kv.arrived() < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    copies()
    state = run(state, KVTransfers())
    assert sorted(copies()) == sorted([("stack_pieces", 1, 1, 2), ("stack_pieces", 2, 4, 2), ("scatter_blocks", 8)])
    for a, b in zip(pages(state), before):
        assert np.array_equal(a[8:15], b[1:8]) and np.array_equal(a[:8], b[:8]) and np.array_equal(a[15:], b[15:])
    assert runner.programs.asked <= {p.key for p in runner.programs.warmup_programs()}, "warm-up misses a copy program"


def test_each_copy_program_runs_before_the_first_step_writing_nothing(monkeypatch):
    """A program's first run on the GPU holds the host far longer than its later runs (its kernels
    load), so the runner runs every copy program after warm-up (`HostKV.run_each_once`, from
    `Runner.run_each_once`): every gather, stack and scatter that warm-up compiled, and the random
    pages stay bitwise."""
    model, params = load_model(DATA / "models" / "tiny-llama", "float32")
    runner = Runner(model, params, RunnerConfig(max_model_len=64, block_size=4, num_blocks=16, num_host_blocks=8))
    state = random_state(runner, 3)
    before = pages(state)
    calls = recorded_programs(monkeypatch, runner)
    state = runner.host_kv.run_each_once(state)
    compiled = [p.key for p in runner.programs.warmup_programs() if p.key[0] in COPY_PROGRAMS]
    smaller = len(runner.host_kv.buckets) - 1  # a gather and a stack for each; the scatters take the largest only
    assert set(calls) == set(compiled) and len(compiled) == 2 * (smaller + 4) + 4
    assert all(np.array_equal(a, b) for a, b in zip(pages(state), before))


def test_transfers_outside_the_cache_or_the_pool_are_refused():
    model, params = load_model(DATA / "models" / "tiny-llama", "float32")
    cfg = RunnerConfig(max_model_len=64, block_size=4, num_blocks=16, num_host_blocks=8)
    runner = Runner(model, params, cfg)
    state = runner.init_state()
    for transfers in (KVTransfers(loads=((8, 1),)), KVTransfers(saves=(((16, 0),),)), KVTransfers(loads=((-1, 0),))):
        with pytest.raises(ValueError, match="kv_transfers.*outside the 16 device blocks or the 8 host slots"):
            runner.execute_model(state, SchedulerOutput(kv_transfers=transfers))
    with pytest.raises(ValueError, match="kv_transfers.frees: .* outside the 8 host slots"):
        runner.execute_model(state, SchedulerOutput(kv_transfers=KVTransfers(frees=(8,))))
    with pytest.raises(ValueError, match=r"pieces of \[3\] blocks; this runner copies pieces of \[1, 2, 4, 8, 16\]"):
        runner.execute_model(state, SchedulerOutput(kv_transfers=KVTransfers(saves=(((1, 0), (2, 1), (3, 2)),))))
    with pytest.raises(ValueError, match="kv_transfers.loads: host slot 3 holds no block"):
        runner.execute_model(state, SchedulerOutput(kv_transfers=KVTransfers(loads=((3, 1),))))
    plain = Runner(model, params, dataclasses.replace(cfg, num_host_blocks=0))
    with pytest.raises(ValueError, match="without a host tier"):
        plain.execute_model(plain.init_state(), SchedulerOutput(kv_transfers=KVTransfers(saves=(((1, 0),),))))
    with pytest.raises(ValueError, match=r"kv_transfers.loads must be \(block, slot\) pairs"):
        KVTransfers(loads=((1, 2, 3),))
    with pytest.raises(ValueError, match=r"kv_transfers.saves must be pieces"):
        KVTransfers(saves=((1, 0),))


def conversations(llm: LLM, users: int = 3, turns: int = 3) -> list[list]:
    """Each user's turns one after another, each turn its whole conversation so far plus a new
    message: the prefixes come back, after the other users' turns have pushed them out."""
    rng = np.random.default_rng(0)
    history = [rng.integers(3, 200, 40).tolist() for _ in range(users)]
    outputs = []
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    for _ in range(turns):
        for u in range(users):
            out = llm.generate([{"prompt_token_ids": history[u]}], params, use_tqdm=False)[0].outputs[0]
            outputs.append(out)
            history[u] = history[u] + list(out.token_ids) + rng.integers(3, 200, 9).tolist()
    return outputs


@pytest.mark.parametrize("name, kv_cache_dtype, num_blocks, warm", [("tiny-llama", "auto", 10, True),
                                                                     ("tiny-gemma3", "fp8", 14, False)])
def test_a_multi_turn_workload_gives_the_same_tokens_with_the_tier(name, kv_cache_dtype, num_blocks, warm, monkeypatch):
    """A device cache that holds one conversation (of three) at a time: without the tier each turn
    computes its conversation again, with it the prefix comes back from host memory (every
    KV-cache group: Gemma-3's sliding and full layers; fp8 pages). Same tokens, logprobs within
    float noise (recomputed KV is not bitwise the KV computed before). `warm`: the programs
    compiled first, as on a GPU (the copies then run warm-up's executables, which take their
    arguments exactly as they were compiled). Gemma-3's runs once more with two blocks loading at
    once: each prefix comes back a block of each group per part, all of it, as without the bound.
    One request runs at a time, so one request bucket: warm-up compiles no sampler it never uses."""
    from jaxrunner.engine import engine
    from jaxrunner.runner import context

    args = dict(skip_tokenizer_init=True, dtype="float32", max_model_len=128, max_num_seqs=1, max_num_batched_tokens=32,
                num_gpu_blocks_override=num_blocks, kv_cache_dtype=kv_cache_dtype, enforce_eager=not warm)
    runs = {}
    for tier in (None, 0.01) if warm else (None, 0.01, "two blocks at once"):
        if tier == "two blocks at once":
            monkeypatch.setattr(context, "KV_TRANSFER_BYTES", 1)  # pieces of one block
            monkeypatch.setattr(engine, "host_tier_max_loads", lambda *_: 2)
        with LLM(str(DATA / "models" / name), kv_offloading_size=None if tier is None else 0.01, **args) as llm:
            runs[tier] = conversations(llm), llm.llm_engine.stats()
    (plain, plain_stats), (tiered, stats) = runs[None], runs[0.01]
    if not warm:
        bounded, bounded_stats = runs["two blocks at once"]
        assert [o.token_ids for o in bounded] == [o.token_ids for o in plain]
        assert bounded_stats.kv_offload_hits == stats.kv_offload_hits
    assert [o.token_ids for o in tiered] == [o.token_ids for o in plain]
    for a, b in zip(tiered, plain):
        for rows_a, rows_b in zip(a.logprobs, b.logprobs):
            assert rows_a.keys() == rows_b.keys()
            np.testing.assert_allclose([r.logprob for r in rows_a.values()], [r.logprob for r in rows_b.values()],
                                       atol=2e-2 if kv_cache_dtype == "fp8" else 1e-4)
    assert stats.kv_offload_hits >= 6 * 16, "the later turns' prefixes did not come from the host tier"
    assert stats.prefix_cache_hits > plain_stats.prefix_cache_hits
    assert stats.kv_offload_bytes_loaded > 0 and stats.kv_offload_bytes_saved > 0
    assert plain_stats.kv_offload_hits == plain_stats.kv_offload_bytes_saved == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(kv_offloading_size=0), "kv_offloading_size must be a positive number of GiB, got 0"),
    (dict(kv_offloading_size="4"), "positive number of GiB, got '4'"),
    (dict(kv_offloading_size=True), "positive number of GiB, got True"),
    (dict(kv_offloading_size=1, enable_prefix_caching=False), "needs enable_prefix_caching=True"),
])
def test_bad_offloading_sizes_fail_at_once(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)


@pytest.mark.parametrize("size, replicas, message", [
    (1e-9, 1, r"1e-09 GiB holds no KV block of \d+ bytes; raise it"),
    (1e6, 1, r"1000000.0 GiB is more than this machine's [\d.]+ GiB of memory"),
    (0.6, 2, r"[\d.]+ GiB times data_parallel_size=2 is more than this machine's [\d.]+ GiB of memory"),
])
def test_an_offloading_size_that_does_not_fit_says_so(size, replicas, message):
    """(The third case's size is 60% of this machine's memory: each replica takes it.)"""
    if replicas > 1:
        size = round(size * os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30, 3)
    with pytest.raises(ValueError, match=f"kv_offloading_size={message}"):
        LLM(str(DATA / "models" / "tiny-llama"), skip_tokenizer_init=True, dtype="float32", max_model_len=128,
            kv_offloading_size=size, data_parallel_size=replicas)
