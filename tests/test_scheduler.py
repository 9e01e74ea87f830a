"""Scheduler: token budget, chunked prefill, decodes first, FCFS, max_num_seqs, preemption by
recompute, stop conditions; and a property test over random workloads (with a fake runner)."""

from __future__ import annotations

from collections import deque

import pytest
from engine_fakes import VOCAB, FakeRunner, check_scheduler_invariants, reference_output
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from jaxrunner.engine.block_manager import BlockManager, blocks_to_hold, null_blocks
from jaxrunner.engine.host_tier import HostTier
from jaxrunner.engine.request import Request, RequestStatus
from jaxrunner.engine.scheduler import Scheduler, SchedulerConfig
from jaxrunner.sampling_params import SamplingParams
from jaxrunner.step_io import RunnerOutput


def make(max_num_seqs=4, budget=8, max_model_len=64, block_size=4, num_blocks=64, caching=True, num_steps=1,
         windows=(None,), host_blocks=0, load_delay=0, max_loads=None, piece_sizes=(1,)):
    """`windows`: each KV-cache group's sliding window (None: full attention). `host_blocks`: a host
    tier's, whose loads arrive `load_delay` steps later than they could, at most `max_loads` rows
    loading at once, its saves in pieces of `piece_sizes`."""
    runner = FakeRunner(num_blocks, block_size, max_num_seqs, budget, max_model_len, windows, host_blocks, load_delay)
    host_tier = HostTier(host_blocks, runner.arrived, max_loads, piece_sizes) if host_blocks else None
    runner.max_loads = host_tier.max_loads if host_tier else 0
    scheduler = Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len, num_steps),
                          BlockManager(num_blocks, block_size, caching, windows, host_tier=host_tier))
    return scheduler, runner


def req(req_id: str, prompt_len: int, max_tokens: int = 8, first: int = 0, **params) -> Request:
    prompt = [(first + i) % VOCAB for i in range(prompt_len)]
    return Request(req_id, prompt, SamplingParams(**params), max_tokens=max_tokens)


def step(scheduler: Scheduler, runner: FakeRunner):
    sched = scheduler.schedule()
    check_scheduler_invariants(scheduler)
    return sched, scheduler.update_from_output(runner.step(sched))


def run_all(
    scheduler: Scheduler,
    runner: FakeRunner,
    arrivals: dict[int, list[Request]],
    max_steps: int = 5000,
    async_scheduling: bool = False,
) -> int:
    """Add requests at their arrival steps and step until every request finished; the step count.
    With `async_scheduling`, each step is scheduled before the previous one's output is taken."""
    n, in_flight = 0, deque()
    while n <= max(arrivals, default=0) or scheduler.has_unfinished_requests():
        for request in arrivals.get(n, []):
            scheduler.add_request(request)
        sched = scheduler.schedule()
        check_scheduler_invariants(scheduler)
        in_flight.append(runner.step(sched))
        while len(in_flight) > (1 if async_scheduling and sched.total_num_scheduled_tokens else 0):
            scheduler.update_from_output(in_flight.popleft())
        n += 1
        assert n < max_steps, "the scheduler stopped making progress"
    step(scheduler, runner)  # report the last finished requests to the runner
    assert not runner.rows and not scheduler.block_manager.req_blocks
    bm = scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks - bm.num_reserved
    return n


def test_chunked_prefill_under_the_token_budget():
    scheduler, runner = make(budget=8)
    a, b = req("a", 10), req("b", 5, first=20)
    scheduler.add_request(a)
    scheduler.add_request(b)
    sched, _ = step(scheduler, runner)
    assert sched.num_scheduled_tokens == {"a": 8}  # a's first chunk takes the whole budget
    sched, new_tokens = step(scheduler, runner)
    assert sched.num_scheduled_tokens == {"a": 2, "b": 5}  # a's last chunk first, then b is admitted
    assert [n.req_id for n in sched.scheduled_new_reqs] == ["b"]
    assert sched.scheduled_cached_reqs.req_ids == ["a"] and sched.scheduled_cached_reqs.num_computed_tokens == [8]
    assert set(new_tokens) == {"a", "b"}
    sched, _ = step(scheduler, runner)
    assert sched.num_scheduled_tokens == {"a": 1, "b": 1}


def test_decodes_go_first_and_a_new_prefill_gets_the_rest():
    scheduler, runner = make(budget=4)
    scheduler.add_request(req("a", 3))
    step(scheduler, runner)
    scheduler.add_request(req("b", 10, first=30))
    sched, _ = step(scheduler, runner)
    assert list(sched.num_scheduled_tokens.items()) == [("a", 1), ("b", 3)]


def test_max_num_seqs_and_fcfs():
    scheduler, runner = make(max_num_seqs=2, budget=64)
    for i in range(3):
        scheduler.add_request(req(f"r{i}", 4, max_tokens=2 + i, first=10 * i))
    sched, _ = step(scheduler, runner)
    assert list(sched.num_scheduled_tokens) == ["r0", "r1"]
    step(scheduler, runner)  # r0 finishes (2 tokens)
    sched, _ = step(scheduler, runner)
    assert sched.finished_req_ids == {"r0"} and [n.req_id for n in sched.scheduled_new_reqs] == ["r2"]


def test_preemption_by_recompute_keeps_outputs():
    # 6 blocks of 4 tokens: two requests of 6 + 12 tokens cannot both finish without preemption.
    scheduler, runner = make(max_num_seqs=2, budget=16, max_model_len=24, num_blocks=6)
    a, b = req("a", 6, max_tokens=12), req("b", 6, max_tokens=12, first=25)
    seen_resume = []
    scheduler.add_request(a)
    scheduler.add_request(b)
    while scheduler.has_unfinished_requests():
        sched, _ = step(scheduler, runner)
        for new in sched.scheduled_new_reqs:
            if new.prefill_token_ids is not None:
                seen_resume.append(new)
                assert new.prefill_token_ids[: len(new.prompt_token_ids)] == new.prompt_token_ids
                assert len(new.prefill_token_ids) > len(new.prompt_token_ids)
    assert scheduler.num_preemptions > 0 and b.num_preemptions > 0 and seen_resume
    assert a.output_token_ids == reference_output(a.prompt_token_ids, 12, 24, None)
    assert b.output_token_ids == reference_output(b.prompt_token_ids, 12, 24, None)


def test_preempted_ids_reach_the_runner():
    scheduler, runner = make(max_num_seqs=2, budget=16, max_model_len=24, num_blocks=6)
    scheduler.add_request(req("a", 6, max_tokens=12))
    scheduler.add_request(req("b", 6, max_tokens=12, first=25))
    preempted = set()
    while scheduler.has_unfinished_requests():
        sched, _ = step(scheduler, runner)
        preempted |= sched.preempted_req_ids
        assert not sched.preempted_req_ids & set(sched.num_scheduled_tokens)
    assert preempted == {"b"}  # the most recently admitted request is the victim


@pytest.mark.parametrize(
    ("outputs", "params", "max_tokens", "expected"),
    [
        ([5, 2], {}, 8, ("stop", None)),  # EOS
        ([5, 7], {"stop_token_ids": [7]}, 8, ("stop", 7)),
        ([2], {"min_tokens": 2}, 8, None),  # EOS does not count before min_tokens
        ([2, 2], {"min_tokens": 2}, 8, ("stop", None)),
        ([5, 6], {}, 2, ("length", None)),
        ([5, 2], {}, 2, ("stop", None)),  # EOS on the last allowed token is a stop, as in vLLM
        ([5, 2], {"ignore_eos": True}, 8, None),
    ],
)
def test_check_stop(outputs, params, max_tokens, expected):
    sp = SamplingParams(**params)
    request = Request("r", [1, 1], sp, max_tokens=max_tokens, eos_token_ids=frozenset() if sp.ignore_eos else frozenset({2}))
    request.output_token_ids = outputs
    status = request.check_stop(max_model_len=64)
    assert (None if status is None else (status.finish_reason, request.stop_reason)) == expected


def test_max_model_len_caps_generation():
    request = Request("r", [1] * 6, SamplingParams(), max_tokens=100, output_token_ids=[3, 4])
    assert request.check_stop(max_model_len=8) == RequestStatus.FINISHED_LENGTH_CAPPED


def test_finish_reasons_through_the_scheduler():
    scheduler, runner = make()
    eos_prompt = [3, 1, 4]
    eos = reference_output(eos_prompt, 3, 64, None)[2]  # the toy model's third token becomes "EOS"
    a = Request("a", eos_prompt, SamplingParams(), max_tokens=10, eos_token_ids=frozenset({eos}))
    b = req("b", 5, max_tokens=4)
    run_all(scheduler, runner, {0: [a, b]})
    assert a.status.finish_reason == "stop" and a.output_token_ids[-1] == eos and len(a.output_token_ids) <= 3
    assert b.status.finish_reason == "length" and len(b.output_token_ids) == 4


def test_finish_requests_from_outside():
    scheduler, runner = make(max_num_seqs=1)
    a, b = req("a", 4), req("b", 4, first=9)
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler, runner)
    scheduler.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished_requests() and a.status == b.status == RequestStatus.FINISHED_ABORTED
    sched = scheduler.schedule()
    assert sched.finished_req_ids == {"a"}  # b never reached the runner
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks


def test_add_request_checks():
    scheduler, _ = make(max_model_len=8)
    with pytest.raises(ValueError, match="max_model_len"):
        scheduler.add_request(req("long", 8))
    scheduler.add_request(req("a", 3))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(req("a", 3))


def test_runner_contract_violation_is_reported():
    scheduler, _ = make(budget=4)
    scheduler.add_request(req("a", 10))
    scheduler.schedule()
    bogus = RunnerOutput(["a"], {"a": 0}, [[1]])  # a token for a non-final prefill chunk
    with pytest.raises(RuntimeError, match="expected 0"):
        scheduler.update_from_output(bogus)


def test_shared_prefix_is_computed_once():
    scheduler, runner = make(budget=64, block_size=4)
    prompts = [[7] * 12 + [i] for i in range(3)]
    reqs = [Request(f"r{i}", p, SamplingParams(), max_tokens=3) for i, p in enumerate(prompts)]
    for r in reqs:
        scheduler.add_request(r)
    sched, _ = step(scheduler, runner)
    assert [n.num_computed_tokens for n in sched.scheduled_new_reqs] == [0, 12, 12]
    assert sched.total_num_scheduled_tokens == 13 + 1 + 1
    run_all(scheduler, runner, {})
    assert scheduler.block_manager.stats.hit_rate == pytest.approx(24 / 39)
    for r in reqs:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, 3, 64, None)


def test_an_evicted_prefix_comes_back_from_the_host_tier():
    """A prefix evicted from the device's cache goes to the host tier; a later request with it
    loads it back instead of computing it. It waits one step for its blocks (the copy overlaps that
    step), then runs from past the prefix, and the fake runner reads the copied tokens back."""
    scheduler, runner = make(budget=64, num_blocks=8, host_blocks=16, max_model_len=32)
    a = req("a", 17, max_tokens=2)  # its first four blocks are full and cached
    run_all(scheduler, runner, {0: [a]})
    run_all(scheduler, runner, {0: [req("b", 26, max_tokens=2, first=40)]})  # evicts three of them
    assert runner.num_loaded == 0 and scheduler.block_manager.host_tier.stats.blocks_saved == 3
    c = Request("c", a.prompt_token_ids + [5, 6, 7], SamplingParams(), max_tokens=3)
    scheduler.add_request(c)
    sched, _ = step(scheduler, runner)
    assert sched.num_scheduled_tokens == {} and "c" in scheduler.loading
    assert len(sched.kv_transfers.loads) == 3 and len(sched.kv_transfers.saves) == 3  # b's blocks make room
    sched, _ = step(scheduler, runner)
    assert [(n.req_id, n.num_computed_tokens) for n in sched.scheduled_new_reqs] == [("c", 16)]
    assert sched.num_scheduled_tokens == {"c": 4}
    run_all(scheduler, runner, {})
    assert c.output_token_ids == reference_output(c.prompt_token_ids, 3, 32, None)
    assert scheduler.block_manager.host_tier.stats.hits == 12 and runner.num_loaded == 3


def test_a_request_waits_for_its_loads_and_one_that_ends_meanwhile_keeps_its_blocks_until_then():
    """Loads that take three more steps: the request runs once they have arrived. One aborted while
    its loads are on their way gives its blocks back only when they have arrived (sooner, a new
    request would have them overwritten under it); its id can be used again meanwhile."""
    scheduler, runner = make(budget=64, num_blocks=8, host_blocks=16, max_model_len=32, load_delay=3)
    a = req("a", 17, max_tokens=2)
    run_all(scheduler, runner, {0: [a]})
    run_all(scheduler, runner, {0: [req("b", 26, max_tokens=2, first=40)]})
    c = Request("c", a.prompt_token_ids + [5], SamplingParams(), max_tokens=3)
    scheduler.add_request(c)
    for _ in range(4):
        sched, _ = step(scheduler, runner)
        assert not sched.num_scheduled_tokens and "c" in scheduler.loading
    sched, _ = step(scheduler, runner)
    assert sched.num_scheduled_tokens == {"c": 2}
    run_all(scheduler, runner, {})
    assert c.output_token_ids == reference_output(c.prompt_token_ids, 3, 32, None)

    run_all(scheduler, runner, {0: [req("b2", 26, max_tokens=2, first=40)]})  # evicts a's prefix again
    scheduler.add_request(Request("c", a.prompt_token_ids + [6], SamplingParams(), max_tokens=3))
    step(scheduler, runner)
    held = scheduler.block_manager.num_free_blocks
    scheduler.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.block_manager.num_free_blocks == held and scheduler.has_unfinished_requests()
    d = Request("c", list(range(3, 23)), SamplingParams(), max_tokens=2)  # the same id, while the blocks are parked
    run_all(scheduler, runner, {0: [d]})  # checks every block came back, and d's context
    assert d.output_token_ids == reference_output(d.prompt_token_ids, 2, 32, None)


def test_the_blocks_loading_at_once_are_bounded():
    """With at most two blocks loading at once: a hit of three host blocks loads the first two, then
    the third once they have arrived, and computes only what no cache holds; a second such hit, while
    the first's loads are on their way, waits for them; both give the reference's tokens."""
    scheduler, runner = make(budget=64, num_blocks=12, host_blocks=32, max_model_len=48, load_delay=2, max_loads=2)
    a, b = req("a", 13, max_tokens=2), req("b", 13, max_tokens=2, first=20)
    run_all(scheduler, runner, {0: [a], 1: [b]})
    run_all(scheduler, runner, {0: [req("evict", 44, max_tokens=2, first=40)]})  # pushes both prefixes out
    tier = scheduler.block_manager.host_tier
    assert tier.stats.blocks_saved == 6 and tier.room() == 2
    c = Request("c", a.prompt_token_ids + [5], SamplingParams(), max_tokens=3)
    d = Request("d", b.prompt_token_ids + [6], SamplingParams(), max_tokens=3)
    scheduler.add_request(c)
    scheduler.add_request(d)
    sched, _ = step(scheduler, runner)
    assert len(sched.kv_transfers.loads) == 2 and list(scheduler.loading) == ["c"] and tier.room() == 0
    loads = []
    while "c" in scheduler.loading:
        assert "d" not in scheduler.loading, "d's loads started while c's held the room"
        sched, _ = step(scheduler, runner)
        loads.append(len(sched.kv_transfers.loads))
    assert loads == [0, 0, 1, 0, 0, 2]  # c's third block once its two arrived; d's two as c starts running
    assert "d" in scheduler.loading and c.num_computed_tokens == 12 + sched.num_scheduled_tokens["c"]
    assert sched.num_scheduled_tokens["c"] == 2 and c.num_cached_tokens == 12  # 12 loaded, 2 computed
    run_all(scheduler, runner, {})
    assert c.output_token_ids == reference_output(c.prompt_token_ids, 3, 48, None)
    assert d.output_token_ids == reference_output(d.prompt_token_ids, 3, 48, None)
    assert tier.stats.blocks_loaded == 6 and runner.num_loaded == 6 and tier.stats.hits == 24


def evict_to_host(scheduler, runner, *prompts):
    """Compute `prompts` (caching their blocks), then push them out to the host tier."""
    for i, prompt in enumerate(prompts):
        run_all(scheduler, runner, {0: [Request(f"cached{i}", prompt, SamplingParams(), max_tokens=1)]})
    for i in range(2):
        other = [30 + i + j % (9 - 2 * i) for j in range(40)]
        run_all(scheduler, runner, {0: [Request(f"evicts{i}", other, SamplingParams(), max_tokens=1)]})


def test_a_cut_hit_whose_next_part_finds_no_blocks_computes_from_where_it_is():
    """A hit cut by the bound whose next part cannot get its blocks (a running request holds them)
    computes the rest, its sliding group still holding the window it reads (the next part's
    allocation gives nothing back before it succeeds)."""
    scheduler, runner = make(windows=(None, 4), block_size=4, max_loads=4, host_blocks=64, budget=2, num_blocks=15,
                             max_model_len=44)
    prefix = list(range(24))
    run_all(scheduler, runner, {0: [Request("x", prefix + [40], SamplingParams(), max_tokens=1)]})
    run_all(scheduler, runner, {0: [Request("y", [30 + i % 7 for i in range(40)], SamplingParams(), max_tokens=1)]})
    running = Request("running", [45 + i % 3 for i in range(20)], SamplingParams(), max_tokens=40)
    scheduler.add_request(running)
    while running.num_computed_tokens < 20:
        step(scheduler, runner)
    a = Request("a", prefix + [41], SamplingParams(), max_tokens=3)
    scheduler.add_request(a)
    step(scheduler, runner)
    sched, _ = step(scheduler, runner)  # the next part needs four blocks, two are free: a computes on
    assert a.num_computed_tokens == 12 + sched.num_scheduled_tokens["a"]
    assert 0 not in scheduler.block_manager.block_ids("a")[1][-2:], "a window block was given back"
    run_all(scheduler, runner, {})  # the fake runner reads every window back
    assert a.output_token_ids == reference_output(a.prompt_token_ids, 3, 44, None)


def test_room_made_for_a_cut_hit_is_not_taken_by_the_request_that_gave_it():
    """A cut hit that cannot take its blocks at admission, with nothing running, makes the newest
    loading request give its blocks back; that one waits (it is not admitted again in the same
    step, which would take them back each step for ever)."""
    scheduler, runner = make(block_size=4, max_loads=3, host_blocks=64, budget=32, num_blocks=11, max_model_len=44)
    first, second = list(range(16)), [20 + i for i in range(8)]
    evict_to_host(scheduler, runner, first + [49], second + [49])
    a = Request("a", first + [40 + i % 5 for i in range(20)], SamplingParams(), max_tokens=2)
    b = Request("b", second + [45], SamplingParams(), max_tokens=2)
    run_all(scheduler, runner, {0: [a, b]}, max_steps=200)
    assert scheduler.num_preemptions <= 2
    for r in (a, b):
        assert r.output_token_ids == reference_output(r.prompt_token_ids, 2, 44, None)


def test_a_cut_hit_takes_no_lookahead_blocks_before_its_next_part():
    """With a draft model's lookahead, a cut hit takes only its part's blocks: the next part's go
    right after them (a lookahead block between would leave a block unwritten in the context)."""
    runner = FakeRunner(12, 4, 4, 32, 48, (None,), 64, 0)
    runner.max_loads = 2
    scheduler = Scheduler(SchedulerConfig(4, 32, 48, num_lookahead_tokens=2),
                          BlockManager(12, 4, True, (None,), host_tier=HostTier(64, runner.arrived, 2)))
    evict_to_host(scheduler, runner, list(range(16)) + [49])
    a = Request("a", list(range(16)) + [48], SamplingParams(), max_tokens=3)
    scheduler.add_request(a)
    step(scheduler, runner)
    assert a.num_computed_tokens == 8 and len(scheduler.block_manager.block_ids("a")[0]) == 2
    run_all(scheduler, runner, {})
    assert a.output_token_ids == reference_output(a.prompt_token_ids, 3, 48, None)


def test_the_host_pool_evicts_whole_pieces_least_recently_used_first():
    """The host tier's books: a step's saves become pieces of the copy sizes (five blocks: 4 + 1); a
    find makes its piece the most recent; a full pool evicts the least recent piece whole and tells
    the runner its slots (`frees`), so the pieces never hold more than the pool; a load counts its
    piece's rows, whole, against the room."""
    tier = HostTier(6, arrived=lambda: 0, max_loads=6, piece_sizes=(1, 2, 4))
    keys = [(0, bytes([i])) for i in range(8)]
    for block, key in enumerate(keys[:5]):
        tier.offload(block, key)
    first = tier.take()
    assert [[block for block, _ in piece] for piece in first.saves] == [[0, 1, 2, 3], [4]] and not first.frees
    slots = {key: slot for piece, run in zip(first.saves, (keys[:4], keys[4:5])) for key, (_, slot) in zip(run, piece)}
    assert tier.find(keys[0]) == slots[keys[0]]  # the four-block piece is now the most recent
    tier.offload(5, keys[5])  # the last free slot
    tier.offload(6, keys[6])  # evicts the one-block piece
    second = tier.take()
    assert second.frees == (slots[keys[4]],) and [len(piece) for piece in second.saves] == [2]
    assert tier.find(keys[4]) is None and tier.find(keys[1]) == slots[keys[1]]
    tier.offload(7, keys[7])  # evicts the least recent piece: the two saved last step, not the one just found
    third = tier.take()
    assert sorted(third.frees) == sorted(slot for _, slot in second.saves[0]) and len(third.saves[0]) == 1
    assert [tier.find(key) is not None for key in keys] == [True] * 4 + [False] * 3 + [True]
    assert tier.rows([slots[keys[2]]]) == 4 and tier.room() == 6
    tier.load(slots[keys[2]], 20)
    assert tier.rows([slots[keys[0]], slots[keys[3]]]) == 0 and tier.room() == 2  # that piece moves already
    assert len(tier.take().loads) == 1 and tier.room() == 2  # on its way until it arrives


@st.composite
def workloads(draw, offload: bool = False):
    """`offload`: a device cache with little room beyond one request and a host tier, and requests
    arriving over a longer time, so that prefixes come back after their eviction."""
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(4, 40))
    budget = draw(st.integers(1, 32))
    window = draw(st.integers(1, 12))
    windows = draw(st.sampled_from([(None,), (window,), (None, window), (None, window, window)]))
    min_blocks = null_blocks(windows) + blocks_to_hold(max_model_len, block_size, windows, budget)
    pieces = draw(st.sampled_from([(1,), (1, 2), (1, 2, 4)]))  # the sizes a step's saves are packed in
    config = {
        "block_size": block_size,
        "max_model_len": max_model_len,
        "max_num_seqs": draw(st.integers(1, 5)),
        "budget": budget,
        "num_blocks": draw(st.integers(min_blocks, min_blocks + 2 if offload else 3 * min_blocks)),
        "caching": offload or draw(st.booleans()),
        "windows": windows,
        "host_blocks": draw(st.sampled_from([1, 3, 16, 64] if offload else [0, 16])),
        "load_delay": draw(st.integers(0, 3)) if offload else 0,
        "max_loads": draw(st.sampled_from([None, pieces[-1], pieces[-1] + 2])) if offload else None,
        "piece_sizes": pieces,
    }
    tokens = st.integers(0, VOCAB - 1)
    prefixes = draw(st.lists(st.lists(tokens, min_size=4 * offload, max_size=16), min_size=1, max_size=3))
    requests = draw(
        st.lists(
            st.tuples(
                st.integers(0, 40 if offload else 12),  # arrival step
                st.integers(0, len(prefixes) - 1),  # shared prefix
                st.lists(tokens, max_size=10),  # own suffix
                st.integers(1, 16),  # max_tokens
                st.one_of(st.none(), tokens),  # EOS
            ),
            min_size=1,
            max_size=12 if offload else 8,
        )
    )
    return config, prefixes, requests


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@pytest.mark.parametrize("async_scheduling, num_steps", [(False, 1), (True, 1), (False, 4), (True, 4)])
@given(workloads())
def test_random_workloads_respect_budgets_and_finish_correctly(async_scheduling, num_steps, workload):
    """Budgets are never exceeded, no block is leaked or wrongly shared (the fake runner reads every
    context back through the block tables), and every request finishes with the tokens it would
    produce alone: also when steps are scheduled before the last output is back, and with
    multi-step decode (whose extra tokens past a stop are dropped)."""
    run_workload(workload, async_scheduling, num_steps)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@pytest.mark.parametrize("async_scheduling, num_steps", [(False, 1), (True, 1), (True, 4)])
@given(workloads(offload=True))
@example(({"block_size": 2, "max_model_len": 24, "max_num_seqs": 1, "budget": 1, "num_blocks": 7, "caching": True,
           "windows": (8,), "host_blocks": 8, "load_delay": 0, "max_loads": 2, "piece_sizes": (1,)},
          [[0] * 17], [(0, 0, [], 1, None), (0, 0, [0] * 5, 1, None), (0, 0, [], 1, None), (0, 0, [], 1, None),
                       (0, 0, [0] * 6, 1, None)]))
def test_random_workloads_with_a_host_tier(async_scheduling, num_steps, workload):
    """The same, where evicted prefixes come back from a host tier, their loads taking up to three
    steps more: the fake runner copies blocks in the runner's order, so a block loaded wrong, read
    before it arrived, or written over a block in use shows up, and a run that stops progressing
    (requests holding blocks for their loads while others need them) fails. The example: a hit cut
    into parts whose sliding group gives back the first part's blocks as the second is taken (a
    request that kept them held the whole pool)."""
    run_workload(workload, async_scheduling, num_steps)


def run_workload(workload, async_scheduling: bool, num_steps: int) -> None:
    config, prefixes, specs = workload
    scheduler, runner = make(**config, num_steps=num_steps)
    arrivals: dict[int, list[Request]] = {}
    for i, (arrival, prefix, suffix, max_tokens, eos) in enumerate(specs):
        prompt = (prefixes[prefix] + suffix)[: config["max_model_len"] - 1] or [0]
        eos_ids = frozenset() if eos is None else frozenset({eos})
        request = Request(f"r{i}", prompt, SamplingParams(), max_tokens=max_tokens, eos_token_ids=eos_ids)
        arrivals.setdefault(arrival, []).append(request)
    run_all(scheduler, runner, arrivals, async_scheduling=async_scheduling)
    for request in (r for rs in arrivals.values() for r in rs):
        assert request.is_finished
        expected = reference_output(
            request.prompt_token_ids, request.max_tokens, config["max_model_len"], next(iter(request.eos_token_ids), None)
        )
        assert request.output_token_ids == expected
