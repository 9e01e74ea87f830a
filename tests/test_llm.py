"""LLM.generate end to end on the real Runner (CPU, the built-in tiny model and a tiny checkpoint):
prefix caching, preemption, stop handling as in vLLM, per-request errors, n > 1, streaming."""

from __future__ import annotations

import dataclasses

from pathlib import Path

import numpy as np
import pytest

from jaxrunner.engine import LLM
from jaxrunner.engine.default_model import TINY_MODEL
from jaxrunner.sampling_params import SamplingParams

DATA = Path(__file__).parent / "data"
ENGINE = {"model": TINY_MODEL, "max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 128}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
SYSTEM = "You are a terse assistant. Answer in one short line, no more. "
QUESTIONS = ["What is JAX?", "Name a prime.", "Is the sky blue?", "2+2?"]  # no common first character


@pytest.fixture(scope="module")
def llm():
    """The built-in model, prefix caching on, a KV pool that holds every sequence at full length."""
    return LLM(**ENGINE)


@pytest.fixture(scope="module")
def uncached():
    """The same engine with prefix caching off: every prompt computed, in whatever slot."""
    return LLM(enable_prefix_caching=False, **ENGINE)


def texts(outputs) -> list[str]:
    return [o.outputs[0].text for o in outputs]


def test_outputs_have_vllm_shape(llm):
    (out,) = llm.generate("Hello, my name is", GREEDY, use_tqdm=False)
    tok = llm.get_tokenizer()
    assert out.prompt == "Hello, my name is" and out.prompt_token_ids == tok.encode("Hello, my name is")
    assert out.finished and out.error is None and len(out.outputs) == 1
    c = out.outputs[0]
    assert c.index == 0 and c.finished() and c.logprobs is None
    visible = c.token_ids[:-1] if c.finish_reason == "stop" else c.token_ids
    assert c.text == tok.decode(visible, skip_special_tokens=True)
    assert c.finish_reason == "stop" or (c.finish_reason == "length" and len(c.token_ids) == 24)


def test_prompt_forms_and_per_prompt_params(llm):
    ids = llm.get_tokenizer().encode("Bonjour")
    forms = ["Bonjour", ids, {"prompt_token_ids": ids}, {"prompt": "Bonjour"}]
    outs = llm.generate(forms, GREEDY, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert [o.prompt for o in outs] == ["Bonjour", None, None, "Bonjour"]
    short = llm.generate(
        ["Bonjour", "Bonjour"],
        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 5)],
        use_tqdm=False,
    )
    assert [len(o.outputs[0].token_ids) for o in short] == [3, 5]
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)


def test_shared_prefix_hits_the_cache_and_matches_no_caching(llm, uncached):
    prompts = [SYSTEM + q for q in QUESTIONS]
    stats = llm.llm_engine.block_manager.stats
    queries, hits = stats.queries, stats.hits
    cached = llm.generate(prompts, GREEDY, use_tqdm=False)
    shared = len(llm.get_tokenizer().encode(SYSTEM)) // 16 * 16
    assert [o.num_cached_tokens for o in cached] == [0] + [shared] * 3
    hit_rate = (stats.hits - hits) / (stats.queries - queries)
    assert hit_rate == pytest.approx(3 * shared / sum(len(o.prompt_token_ids) for o in cached))
    assert hit_rate > 0.4
    plain = uncached.generate(prompts, GREEDY, use_tqdm=False)
    assert texts(cached) == texts(plain)
    assert [o.outputs[0].token_ids for o in cached] == [o.outputs[0].token_ids for o in plain]


def test_penalties_over_a_cached_prefix_read_its_tokens_not_the_slots_last_occupant(llm, uncached):
    """Penalties and bad words read a request's token history from its slot's row: a prompt whose
    prefix comes from the cache must find that prefix there, whatever ran in the slot before."""
    llm.generate([c * 80 for c in "#$%&"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    prompts = [SYSTEM + q for q in QUESTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=2.0, presence_penalty=0.5,
                            frequency_penalty=0.3, bad_words=["ab", "e t"])
    cached = llm.generate(prompts, params, use_tqdm=False)
    assert min(o.num_cached_tokens for o in cached[1:]) > 0
    plain = uncached.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in cached] == [o.outputs[0].token_ids for o in plain]


def test_tiny_kv_pool_preempts_and_keeps_greedy_outputs(llm):
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    prompts = [f"Request {i}: tell me a story." for i in range(4)]  # 4 x (29 + 48) tokens > 8 blocks of 16
    roomy = llm.generate(prompts, params, use_tqdm=False)
    small = LLM(num_gpu_blocks_override=8, **ENGINE)
    tight = small.generate(prompts, params, use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert all(o.finished and len(o.outputs[0].token_ids) == 48 for o in tight)
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]


def greedy_base(llm, prompt: str):
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]


def first_tokens_containing(tok, token_ids: list[int], text: str) -> list[int]:
    """The shortest prefix of `token_ids` whose text contains `text`."""
    for k in range(1, len(token_ids) + 1):
        if text in tok.decode(token_ids[:k], skip_special_tokens=True):
            return token_ids[:k]
    raise AssertionError(f"{text!r} not in the output")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_text_like_vllm(llm, include):
    base = greedy_base(llm, "Once upon a time")
    stop = base.text[6:9]
    params = SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, stop=["@@@@", stop], include_stop_str_in_output=include
    )
    (out,) = llm.generate("Once upon a time", params, use_tqdm=False)
    c = out.outputs[0]
    cut = base.text.index(stop) + (len(stop) if include else 0)
    assert c.text == base.text[:cut]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    assert c.token_ids == first_tokens_containing(llm.get_tokenizer(), base.token_ids, stop)  # ids are not cut


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_id_ends_output_like_vllm(llm, include):
    base = greedy_base(llm, "Once upon a time")
    stop_id = base.token_ids[5]
    params = SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_id], include_stop_str_in_output=include
    )
    c = llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0]
    k = base.token_ids.index(stop_id) + 1
    tok = llm.get_tokenizer()
    assert c.token_ids == base.token_ids[:k]
    assert c.text == tok.decode(base.token_ids[: k if include else k - 1], skip_special_tokens=True)
    assert (c.finish_reason, c.stop_reason) == ("stop", stop_id)


def test_max_tokens_and_max_model_len(llm):
    c = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert (len(c.token_ids), c.finish_reason) == (7, "length")
    long_prompt = list(range(3, 99)) + list(range(3, 27))  # 120 tokens: 8 left before max_model_len=128
    out = llm.generate(long_prompt, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False)[0]
    assert (len(out.outputs[0].token_ids), out.outputs[0].finish_reason) == (8, "length")


def test_prompt_longer_than_max_model_len_fails_alone(llm):
    prompts = ["First prompt.", "x" * 200, "Third prompt."]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    bad = outs[1]
    assert bad.finished and bad.outputs[0].finish_reason == "error" and bad.outputs[0].token_ids == []
    assert "prompt (length 201) is longer than the maximum model length of 128" in bad.error
    full = llm.generate(list(range(3, 99)) + list(range(3, 35)), GREEDY, use_tqdm=False)[0]  # exactly 128 tokens
    assert full.outputs[0].finish_reason == "error" and "leaving no room for output" in full.error
    alone = llm.generate([prompts[0], prompts[2]], GREEDY, use_tqdm=False)
    assert texts([outs[0], outs[2]]) == texts(alone) and outs[0].error is None


def test_n_completions_share_the_prompt_blocks(llm):
    prompt = "A fairly long shared prompt for several completions."
    (one,) = llm.generate(prompt, GREEDY, use_tqdm=False)
    hits = llm.llm_engine.block_manager.stats.hits
    (three,) = llm.generate(prompt, SamplingParams(n=3, temperature=0, max_tokens=24), use_tqdm=False)
    assert [c.index for c in three.outputs] == [0, 1, 2]
    assert all(c.token_ids == one.outputs[0].token_ids for c in three.outputs)
    assert llm.llm_engine.block_manager.stats.hits - hits >= 3 * 48  # every child found the prompt's 3 full blocks
    seeded = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    a, b = (llm.generate(prompt, seeded, use_tqdm=False)[0] for _ in range(2))
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert a.outputs[0].token_ids != a.outputs[1].token_ids


def test_streaming_deltas_add_up_to_generate(llm):
    prompts = ["Stream me", "And me too"]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=["zz"])
    final = llm.generate(prompts, params, use_tqdm=False)
    text, ids, finished = {}, {}, []
    for out in llm.generate_stream(prompts, params):
        assert not finished or out.request_id not in finished
        for c in out.outputs:
            text[out.request_id] = text.get(out.request_id, "") + c.text
            ids[out.request_id] = ids.get(out.request_id, []) + c.token_ids
        if out.finished:
            finished.append(out.request_id)
    assert len(finished) == 2
    assert sorted(text.values()) == sorted(texts(final))
    assert sorted(ids.values()) == sorted(o.outputs[0].token_ids for o in final)


def test_closing_a_stream_early_aborts(llm):
    stream = llm.generate_stream("Stop early", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    next(stream)
    stream.close()
    assert not llm.llm_engine.has_unfinished_requests()


def test_params_the_runner_refuses_raise_before_anything_runs(llm, monkeypatch):
    def refuse_top_k(params: SamplingParams, prompt_len: int) -> None:
        if params.top_k != -1:
            raise ValueError("sampling parameter top_k is not supported by this runner yet")

    engine = llm.llm_engine
    monkeypatch.setattr(engine, "processor", dataclasses.replace(engine.processor, check_params=refuse_top_k))
    with pytest.raises(ValueError, match="top_k"):
        llm.generate(["fine", "not fine"], [GREEDY, SamplingParams(top_k=5)], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_running_out_of_device_memory_at_start_up_names_the_kv_cache_and_the_knobs(monkeypatch):
    """XLA's allocator failing as the KV cache is made (at start, and again after warm-up's compiles)
    comes out as an error with the cache's size, what to lower and, on a GPU, the pool's state (a
    largest free block below the bytes free says the memory is in pieces); other runtime errors
    pass as they are."""
    from jax.errors import JaxRuntimeError

    from jaxrunner import platform
    from jaxrunner.runner import Runner

    def exhausted(self):
        raise JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 956006400 bytes.")

    monkeypatch.setattr(Runner, "init_state", exhausted)
    with pytest.raises(MemoryError, match=r"making the KV cache, with a KV cache of 16 blocks \(0\.\d+ GiB\) set by "
                                          r"num_gpu_blocks_override=16: lower gpu_memory_utilization"):
        LLM(**ENGINE, num_gpu_blocks_override=16)
    pool = {"bytes_in_use": 70 * 2**30, "bytes_limit": 75 * 2**30, "largest_free_block_bytes": 2**29}  # a GPU's
    monkeypatch.setattr(platform, "memory_stats", lambda device=0: pool)
    with pytest.raises(MemoryError, match=r"the device's pool then: 70\.00 of 75\.00 GiB in use, its largest free "
                                          r"block 0\.50 GiB: lower"):
        LLM(**ENGINE, num_gpu_blocks_override=16)
    monkeypatch.setattr(Runner, "init_state", lambda self: (_ for _ in ()).throw(JaxRuntimeError("INTERNAL: other")))
    with pytest.raises(JaxRuntimeError, match="INTERNAL: other"):
        LLM(**ENGINE, num_gpu_blocks_override=16)
    monkeypatch.undo()
    engine = LLM(**ENGINE, num_gpu_blocks_override=16).llm_engine
    engine.warm = False
    monkeypatch.setattr(engine.runner, "warmup", lambda progress, background: {})
    monkeypatch.setattr(engine.runner, "init_state", exhausted.__get__(engine.runner))
    with pytest.raises(MemoryError, match="making the KV cache again after the compiles"):
        engine.warm_up()


def test_unknown_engine_argument():
    with pytest.raises(TypeError, match="pipeline_parallel_size"):
        LLM(pipeline_parallel_size=2)


def test_tiny_checkpoint_matches_hf_greedy():
    """A checkpoint without a tokenizer: token-id prompts, empty text, HF's greedy tokens."""
    golden = np.load(DATA / "goldens" / "tiny-llama.npz")
    prompts = [golden[f"prompt_{i}"].tolist() for i in range(4)]
    llm = LLM(**{**ENGINE, "model": str(DATA / "models" / "tiny-llama")}, skip_tokenizer_init=True)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [golden[f"greedy_{i}"].tolist() for i in range(4)]
    assert all(o.outputs[0].text == "" for o in outs)
    with pytest.raises(ValueError, match="need a tokenizer"):
        llm.generate("text", use_tqdm=False)


def test_a_token_budget_below_the_default_request_slots_lowers_them():
    """Only max_num_batched_tokens given, below the platform's default max_num_seqs (256 on a GPU, 8
    here): the slots follow it, so that warm-up's decode of every slot fits a step; a conflicting
    pair given explicitly is refused at once, as vLLM refuses it."""
    with LLM(TINY_MODEL, skip_tokenizer_init=True, max_num_batched_tokens=4, max_model_len=64,
             enforce_eager=False) as llm:
        assert llm.llm_engine.config.max_num_seqs == 4
        out = llm.generate([{"prompt_token_ids": [3, 4, 5, 6, 7, 8]}] * 2, SamplingParams(max_tokens=3), use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in out] == [3, 3]
    with pytest.raises(ValueError, match="max_num_batched_tokens=4 must be at least max_num_seqs=8"):
        LLM(TINY_MODEL, skip_tokenizer_init=True, max_num_seqs=8, max_num_batched_tokens=4)
