"""Several KV-cache groups (Gemma's sliding and full layers, Mistral's sliding ones): the layout,
the block manager giving back what a window has passed, prefix hits that hold every group's
window, and the engine on tiny Gemma 3 and Mistral checkpoints matching Hugging Face while it does."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from engine_fakes import check_block_invariants
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrunner import LLM, NewRequestData, RunnerConfig, SamplingParams, SchedulerOutput
from jaxrunner.config import ModelConfig
from jaxrunner.engine.block_manager import NULL_BLOCK, BlockManager, blocks_to_hold
from jaxrunner.engine.request import Request
from jaxrunner.runner.memory import kv_cache_bytes
from jaxrunner.runner.state import init_state

DATA = Path(__file__).parent / "data"


def model(num_layers: int, layer_types: tuple[str, ...] = (), window: int | None = None) -> ModelConfig:
    return ModelConfig("Gemma3ForCausalLM", 64, 32, 64, num_layers, 2, 1, 16, sliding_window=window,
                       layer_types=layer_types)


GEMMA3_270M = model(18, tuple("full_attention" if i % 6 == 5 else "sliding_attention" for i in range(18)), 512)


def test_layouts_group_layers_of_a_kind_and_share_the_page_arrays():
    assert GEMMA3_270M.kv_cache_groups == ((5, 11, 17), (0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16))
    assert GEMMA3_270M.group_windows == (None,) + (512,) * 5 and GEMMA3_270M.group_size == 3
    assert [GEMMA3_270M.kv_slot(i) for i in (0, 5, 6, 17)] == [(1, 0), (0, 0), (2, 2), (0, 2)]
    gemma2 = model(4, ("sliding_attention", "full_attention") * 2, 16)
    assert gemma2.kv_cache_groups == ((1, 3), (0, 2)) and gemma2.group_windows == (None, 16)
    uneven = model(5, ("full_attention",) * 2 + ("sliding_attention",) * 3, 16)
    assert uneven.kv_cache_groups == ((0, 1), (2, 3), (4,))
    for uniform, window in ((model(3), None), (model(3, window=16), 16)):  # Llama; Mistral, every layer sliding
        assert uniform.kv_cache_groups == ((0, 1, 2),) and uniform.group_windows == (window,)
    cfg = RunnerConfig(num_blocks=4, block_size=8, max_model_len=64)
    state = init_state(GEMMA3_270M, cfg)
    assert len(state.kv) == 3 and state.block_table.shape == (6, cfg.max_num_seqs, 8)
    assert kv_cache_bytes(GEMMA3_270M, cfg) * 6 == kv_cache_bytes(model(18), cfg)  # a block is 3 layers' pages


def test_a_long_request_holds_its_whole_length_only_in_the_full_group():
    """Gemma-3-270M's layout, a 32k-token prompt in 8k chunks, then decodes: each sliding group
    holds its window (and the chunk), not the 2048 blocks the full group needs."""
    bs, chunk = 16, 8192
    windows = GEMMA3_270M.group_windows
    need = blocks_to_hold(32768 + 8, bs, windows, chunk)
    assert need < 3 * 2048  # without giving back, 6 * 2048
    bm = BlockManager(1 + need, bs, windows=windows)
    request = Request("long", list(range(32768)), SamplingParams(), max_tokens=8)
    while request.num_computed_tokens < request.num_tokens:
        n = min(chunk, request.num_tokens - request.num_computed_tokens)
        assert bm.allocate_slots(request, n) is not None
        request.num_computed_tokens += n
    for token in range(8):
        request.output_token_ids.append(token)
        assert bm.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
        held = [sum(b >= bm.num_reserved for b in group) for group in bm.block_ids("long")]
        assert held[0] == -(-request.num_computed_tokens // bs)
        assert all(n <= -(-(512 + bs) // bs) + 1 for n in held[1:]), held
        check_block_invariants(bm)
    given_back = bm.block_ids("long")[1]
    assert given_back[: 32768 // bs - 40] == [NULL_BLOCK] * (32768 // bs - 40)
    bm.free(request)
    assert bm.num_free_blocks == bm.num_blocks - 1
    check_block_invariants(bm)


def first_needed(n: int, bs: int, window: int | None) -> int:
    return 0 if window is None else max(0, n * bs - window + 1) // bs


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_prefix_hits_hold_every_groups_window_and_are_the_longest(data):
    """Random admissions, decodes and frees over a small pool (so blocks are evicted): every hit is
    the longest n blocks for which each group has the blocks its next token reads cached, with
    the null block before a sliding group's window."""
    bs, window = 4, data.draw(st.sampled_from([3, 4, 8, 9]))
    windows = data.draw(st.sampled_from([(None, window), (window,), (None, window, window)]))
    bm = BlockManager(1 + 3 * blocks_to_hold(40, bs, windows, 40), bs, windows=windows)
    prefixes = [[p] * 24 for p in range(3)]
    running: list[Request] = []
    hits_seen = 0
    for i in range(data.draw(st.integers(4, 14))):
        prompt = data.draw(st.sampled_from(prefixes))[: data.draw(st.integers(1, 24))] + data.draw(
            st.lists(st.integers(0, 9), max_size=12))
        request = Request(f"r{i}", prompt, SamplingParams(), max_tokens=8)
        hits, num_hit = bm.get_computed_blocks(request)
        hashes = bm._hashes(request, (request.num_tokens - 1) // bs)

        def valid(n: int) -> bool:
            return all((g, h) in bm.cached for g, w in enumerate(windows) for h in hashes[first_needed(n, bs, w) : n])

        n = num_hit // bs
        assert valid(n) and not any(valid(m) for m in range(n + 1, len(hashes) + 1))
        for g, w in enumerate(windows):
            first = first_needed(n, bs, w)
            assert hits[g] == [NULL_BLOCK] * first + [bm.cached[(g, h)] for h in hashes[first:n]]
        hits_seen += n > 0
        if bm.allocate_slots(request, request.num_tokens - num_hit, hits) is None:
            continue
        request.num_computed_tokens = request.num_tokens
        for _ in range(data.draw(st.integers(0, 6))):  # decodes give blocks back past the window
            request.output_token_ids.append(7)
            if bm.allocate_slots(request, 1) is not None:
                request.num_computed_tokens += 1
        running.append(request)
        check_block_invariants(bm)
        while running and data.draw(st.booleans()):
            bm.free(running.pop(data.draw(st.integers(0, len(running) - 1))))
            check_block_invariants(bm)


def watch_generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], int]:
    """Greedy token ids per prompt, and the most entries any request's sliding group had given back."""
    engine = llm.llm_engine
    bm = engine.block_manager
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    tokens, given_back = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        for rid in list(bm.req_blocks):
            groups = bm.block_ids(rid)
            sliding = [group for group, window in zip(groups, bm.windows) if window is not None]
            given_back = max([given_back] + [group.count(NULL_BLOCK) for group in sliding])
    return [tokens[str(i)] for i in range(len(prompts))], given_back


def test_speculative_decoding_keeps_its_drafts_worth_before_the_window():
    """The scheduler counts drafts in flight as accepted, so the computed count can run k ahead."""
    given_back = []
    for lookbehind in (0, 3):
        bm = BlockManager(64, 4, windows=(8,), lookbehind=lookbehind)
        request = Request("a", list(range(20)), SamplingParams(), max_tokens=8)
        bm.allocate_slots(request, 20)
        request.num_computed_tokens = 20
        bm.allocate_slots(request, 1)
        given_back.append(bm.block_ids("a")[0].count(NULL_BLOCK))
    assert given_back == [(20 - 8 + 1) // 4, (20 - 8 + 1 - 3) // 4]


@pytest.mark.parametrize("name, spec", [("tiny-gemma3", None), ("tiny-mistral", None),
                                        ("tiny-mistral", {"method": "ngram", "num_speculative_tokens": 3,
                                                          "prompt_lookup_min": 1})],
                         ids=["gemma3", "mistral", "mistral-ngram"])
def test_engine_gives_back_sliding_blocks_and_matches_hf(name, spec):
    """Window 16, blocks of 8: past 24 tokens a sliding group holds 3 blocks; the greedy tokens
    still equal Hugging Face's (goldens of scripts/make_goldens.py), with n-gram drafts too."""
    golden = np.load(DATA / "goldens" / f"{name}.npz")
    prompts = [golden[f"prompt_{i}"].tolist() for i in range(4)]
    with LLM(str(DATA / "models" / name), skip_tokenizer_init=True, dtype="float32", block_size=8, max_model_len=128,
             max_num_seqs=4, max_num_batched_tokens=32, speculative_config=spec) as llm:
        assert llm.llm_engine.block_manager.windows == ((None, 16) if name == "tiny-gemma3" else (16,))
        greedy, given_back = watch_generate(llm, prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
        accepted = llm.llm_engine.stats().spec_decoding.get("num_accepted_tokens", 0)
    assert greedy == [golden[f"greedy_{i}"].tolist() for i in range(4)]
    assert given_back >= 2
    assert (accepted > 0) == (spec is not None)


def test_a_draft_model_needs_one_group_and_a_step_one_list_per_group():
    mistral = str(DATA / "models" / "tiny-mistral")
    with pytest.raises(ValueError, match="both need one KV-cache group"):
        LLM(str(DATA / "models" / "tiny-gemma3"), skip_tokenizer_init=True, dtype="float32", max_model_len=128,
            speculative_config={"method": "draft_model", "model": mistral, "num_speculative_tokens": 2})
    with LLM(str(DATA / "models" / "tiny-gemma3"), skip_tokenizer_init=True, dtype="float32", block_size=8,
             max_model_len=128, max_num_batched_tokens=32) as llm:
        runner, state = llm.llm_engine.runner, llm.llm_engine.state
        one_list = SchedulerOutput(
            scheduled_new_reqs=[NewRequestData("r", [1, 2, 3], ([1],), 0, SamplingParams(temperature=0.0))],
            num_scheduled_tokens={"r": 3}, total_num_scheduled_tokens=3)
        with pytest.raises(ValueError, match=r"one list per KV-cache group \(2\), got 1"):
            runner.step(state, one_list)
        short = dataclasses.replace(one_list, scheduled_new_reqs=[
            dataclasses.replace(one_list.scheduled_new_reqs[0], block_ids=([1], []))])
        with pytest.raises(ValueError, match="blocks of KV-cache group 1 cannot hold 3 tokens"):
            runner.step(state, short)
        both = dataclasses.replace(one_list, scheduled_new_reqs=[
            dataclasses.replace(one_list.scheduled_new_reqs[0], block_ids=([1], [2]))])
        state, out = runner.step(state, both)  # the rejected steps changed nothing
        assert out.req_ids == ["r"] and len(out.sampled_token_ids[0]) == 1
