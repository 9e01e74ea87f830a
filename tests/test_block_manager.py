"""KV block manager: allocation, reference counts, prefix caching by chained hashes, LRU eviction."""

from __future__ import annotations

import pytest
from engine_fakes import check_block_invariants

from jaxrunner.engine.block_manager import BlockManager, hash_block
from jaxrunner.engine.request import Request
from jaxrunner.sampling_params import SamplingParams

BS = 4


def request(req_id: str, tokens: list[int], outputs: list[int] = ()) -> Request:
    return Request(req_id, list(tokens), SamplingParams(), max_tokens=16, output_token_ids=list(outputs))


def admit(bm: BlockManager, req: Request, num_new_tokens: int | None = None) -> tuple[list[int], ...] | None:
    """What the scheduler does for a waiting request: look up the prefix cache, then allocate."""
    hits, num_hit = bm.get_computed_blocks(req)
    n = req.num_tokens - num_hit if num_new_tokens is None else num_new_tokens
    fresh = bm.allocate_slots(req, n, hits)
    if fresh is not None:
        req.num_computed_tokens = num_hit + n
    return fresh


def test_allocate_covers_tokens_and_free_returns_everything():
    bm = BlockManager(num_blocks=8, block_size=BS)
    req = request("a", range(10))
    (fresh,) = admit(bm, req)
    assert len(fresh) == 3 and bm.block_ids("a") == (fresh,) and bm.num_free_blocks == 5
    for position in (10, 11, 12):  # decode steps: positions 10 and 11 fit in the third block
        req.output_token_ids.append(90 + position)
        assert len(bm.allocate_slots(req, 1)[0]) == (position == 12)
        req.num_computed_tokens += 1
    check_block_invariants(bm)
    bm.free(req)
    assert bm.num_free_blocks == 8 and bm.block_ids("a") == ([],)
    check_block_invariants(bm)


def test_shared_prefix_hits_full_blocks_and_counts_references():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = request("a", list(range(10)))
    admit(bm, a)
    b = request("b", list(range(9)) + [77, 78])
    hits, num_hit = bm.get_computed_blocks(b)
    assert hits == (bm.block_ids("a")[0][:2],) and num_hit == 8
    admit(bm, b)
    assert bm.block_ids("b")[0][:2] == bm.block_ids("a")[0][:2]
    assert [bm.ref_counts[x] for x in bm.block_ids("a")[0]] == [2, 2, 1]
    assert bm.stats.queries == 21 and bm.stats.hits == 8
    check_block_invariants(bm)
    bm.free(a)
    assert [bm.ref_counts[x] for x in bm.block_ids("b")[0]] == [1, 1, 1]
    check_block_invariants(bm)


def test_last_token_is_never_a_hit():
    bm = BlockManager(num_blocks=16, block_size=BS)
    admit(bm, request("a", range(8)))
    assert bm.get_computed_blocks(request("b", range(8)))[1] == 4  # one block left to compute
    assert bm.get_computed_blocks(request("c", range(9)))[1] == 8


def test_hash_is_chained_over_the_whole_prefix():
    bm = BlockManager(num_blocks=16, block_size=BS)
    admit(bm, request("a", [1, 2, 3, 4, 5, 6, 7, 8, 0]))
    # Same second block, different first block: no hit at all.
    assert bm.get_computed_blocks(request("b", [9, 9, 9, 9, 5, 6, 7, 8, 0]))[1] == 0
    assert hash_block(b"", [1, 2]) != hash_block(hash_block(b"", [0]), [1, 2])


def test_freed_blocks_stay_cached_until_evicted_tail_first():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = request("a", range(13))  # 4 blocks: 3 full (registered) + 1 partial
    admit(bm, a)
    bm.free(a)
    assert bm.get_computed_blocks(request("a2", range(13)))[1] == 12
    # One fresh block: the partial tail block goes first (it was never cached anyway).
    admit(bm, request("x", [50, 51, 52]))
    assert bm.get_computed_blocks(request("a3", range(13)))[1] == 12
    # Another: the third full block (the tail of what is cached) is evicted, the prefix survives.
    admit(bm, request("y", [60, 61, 62]))
    assert bm.get_computed_blocks(request("a4", range(13)))[1] == 8
    check_block_invariants(bm)


def test_hit_revives_a_freed_block_and_recent_frees_are_evicted_last():
    bm = BlockManager(num_blocks=6, block_size=BS)
    a, b = request("a", range(5)), request("b", range(100, 105))
    admit(bm, a)
    admit(bm, b)
    bm.free(a)
    bm.free(b)
    a2 = request("a2", range(5))
    admit(bm, a2)  # revives a's first block from the free queue
    assert bm.block_ids("a2")[0][0] == bm.cached[(0, hash_block(b"", [0, 1, 2, 3]))]
    check_block_invariants(bm)
    # Two fresh blocks: the last never-used one, then a's tail (freed before b's); b's blocks survive.
    admit(bm, request("z", range(200, 207)))
    assert bm.get_computed_blocks(request("b2", range(100, 105)))[1] == 4
    check_block_invariants(bm)


def test_failed_allocation_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = request("a", range(9))
    admit(bm, a)
    bm.free(a)
    before = (list(bm.ref_counts), list(bm.free_queue), dict(bm.cached))
    # Two cached hits sit in the free queue: they cannot also be counted as free blocks for the rest.
    big = request("big", list(range(8)) + list(range(50, 60)))
    assert admit(bm, big) is None
    assert (list(bm.ref_counts), list(bm.free_queue), dict(bm.cached)) == before
    assert "big" not in bm.req_blocks and bm.stats.requests == 1


def test_caching_disabled_never_hits():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_caching=False)
    admit(bm, request("a", range(9)))
    assert bm.get_computed_blocks(request("b", range(9))) == (([],), 0)
    assert not bm.cached and bm.stats.queries == 0


def test_prompt_logprobs_requests_skip_the_cache_but_fill_it():
    """The runner scores only computed positions, so a hit would lose prompt logprobs (as in vLLM)."""
    bm = BlockManager(num_blocks=16, block_size=BS)
    scored = Request("a", list(range(9)), SamplingParams(prompt_logprobs=2), max_tokens=16)
    admit(bm, scored)
    assert bm.get_computed_blocks(request("b", range(9))) == ((bm.block_ids("a")[0][:2],), 8)
    assert bm.get_computed_blocks(scored) == (([],), 0)
    check_block_invariants(bm)


def test_resumed_requests_do_not_count_towards_hit_rate():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = request("a", range(9))
    admit(bm, a)
    bm.free(a)
    a.num_preemptions, a.num_computed_tokens = 1, 0
    admit(bm, a)
    assert bm.stats.requests == 1 and bm.stats.hits == 0


@pytest.mark.parametrize("n", [1, 2, 3])
def test_identical_full_blocks_are_registered_once(n):
    bm = BlockManager(num_blocks=16, block_size=BS)
    for i in range(n):  # identical prompts of exactly two blocks: the second is computed by each
        admit(bm, request(f"r{i}", range(8)))
    assert len(bm.cached) == 2
    check_block_invariants(bm)
