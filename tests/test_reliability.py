"""Faults and bad input: a clean exit with steps in flight, aborts, ids re-used, NaN logits, broken
checkpoints, loose types; each bad thing fails alone and leaves everything else as it was."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import jaxrunner.runner.plan
from jaxrunner import LLM, NewRequestData, Runner, RunnerConfig, SamplingParams, SchedulerOutput
from jaxrunner.cli import main
from jaxrunner.config import SamplerConfig
from jaxrunner.engine import EngineArgs
from jaxrunner.engine.default_model import TINY_MODEL, default_model

ROOT = Path(__file__).parents[1]
TINY_LLAMA = ROOT / "tests" / "data" / "models" / "tiny-llama"
ENGINE = {"model": TINY_MODEL, "max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 96}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    with LLM(**ENGINE) as llm:
        yield llm


def all_blocks_free(llm: LLM) -> bool:
    manager = llm.llm_engine.block_manager
    return manager.num_free_blocks == manager.num_blocks and not any(manager.ref_counts)


EXIT_SCRIPT = textwrap.dedent("""
    from jaxrunner import LLM, SamplingParams
    llm = LLM("jaxrunner-tiny-random", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=96)
    prompts = ["Hello", "abc def", "Once upon"]
    base = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    stops = [o.outputs[0].text[2] for o in base]
    # Every request ends on a stop string: under async scheduling one more step is already dispatched.
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=30, stop=stops), use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["stop"] * 3, outs
    engine = llm.llm_engine  # and the bare engine, left with a step in flight, never closed
    engine.add_request("x", "A last prompt", SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
""")


def test_the_interpreter_exits_cleanly_with_steps_in_flight(tmp_path):
    script = tmp_path / "exit.py"
    script.write_text(EXIT_SCRIPT)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    runs = [subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
            for _ in range(10)]
    assert [run.returncode for run in runs] == [0] * 10, next(run.stderr[-2000:] for run in runs if run.returncode)


def test_generate_returns_with_nothing_in_flight(llm):
    base = llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0]
    params = SamplingParams(temperature=0.0, max_tokens=12, stop=[base.text[2]])
    assert llm.generate("Hello", params, use_tqdm=False)[0].outputs[0].finish_reason == "stop"
    assert not llm.llm_engine._in_flight and all_blocks_free(llm)


def test_a_closed_llm_refuses_work():
    llm = LLM(**ENGINE)
    with llm:
        llm.generate("Hi", GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate("Hi", GREEDY, use_tqdm=False)


def test_a_reused_aborted_id_gets_none_of_the_old_requests_tokens(llm):
    engine = llm.llm_engine
    assert engine.args.async_scheduling
    engine.add_request("r", "An old request", GREEDY)
    engine.step()  # dispatched; its token comes back one step later
    engine.abort_request(["r"], final_output=False)
    engine.add_request("r", "Something else", GREEDY)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == "r" and o.finished]
    alone = llm.generate("Something else", GREEDY, use_tqdm=False)[0]
    assert outs[0].outputs[0].token_ids == alone.outputs[0].token_ids


def test_aborting_inside_a_stream_ends_that_request_and_frees_its_blocks(llm):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    final, seen, tokens = {}, {"Abort me please": 0, "Let me finish": 0}, {"Abort me please": [], "Let me finish": []}
    for out in llm.generate_stream(list(seen), params):
        seen[out.prompt] += 1
        assert sum(seen.values()) < 200, "the stream does not end"
        tokens[out.prompt] += out.outputs[0].token_ids
        if out.prompt == "Abort me please" and seen[out.prompt] == 2:
            llm.llm_engine.abort_request([out.request_id])
        if out.finished:
            final[out.prompt] = out.outputs[0].finish_reason
    assert final == {"Abort me please": "abort", "Let me finish": "length"}
    assert 0 < len(tokens["Abort me please"]) < 40 and len(tokens["Let me finish"]) == 40
    assert all_blocks_free(llm)


def test_an_aborted_request_ends_with_abort_through_the_engine(llm):
    engine = llm.llm_engine
    engine.add_request("a", "Wait in line", GREEDY)
    engine.abort_request(["a"])
    (out,) = engine.step()
    assert out.finished and out.outputs[0].finish_reason == "abort" and not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": float("inf")}, "temperature"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"top_k": 2.5}, "top_k"),
        ({"seed": 1.5}, "seed"),
        ({"n": 2, "seed": 2**64 - 1}, "seed"),
        ({"stop": 5}, "stop"),
        ({"stop": [None]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"bad_words": [""]}, "bad_words"),
        ({"bad_words": "word"}, "bad_words"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_loose_sampling_params_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams: .*{field}"):
        SamplingParams(**kwargs)


def test_numpy_values_are_taken_as_their_python_values(llm):
    params = SamplingParams(temperature=np.float32(0.0), max_tokens=np.int64(5), ignore_eos=True,
                            stop_token_ids=np.array([3]))
    ids = llm.get_tokenizer().encode("Bonjour")
    outs = llm.generate([np.array(ids), ids], params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids and len(outs[0].outputs[0].token_ids) == 5


@pytest.mark.parametrize(
    "prompts, params, message",
    [
        (["fine", [1, True, 3]], GREEDY, "token ids"),
        (["fine", [1, 2.5]], GREEDY, "token ids"),
        (["fine", {"prompt_token_ids": [1, -2]}], GREEDY, "token ids"),
        (["fine", "also fine"], {"temperature": 0.0}, "sampling_params must be a SamplingParams"),
        (["fine", "also fine"], [GREEDY, {"temperature": 0.0}], "sampling_params must be a SamplingParams"),
        (["fine", "also fine"], [GREEDY, SamplingParams(logprobs=21)], "maximum of 20"),
    ],
)
def test_a_bad_prompt_or_parameter_queues_nothing_of_its_call(llm, prompts, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests() and all_blocks_free(llm)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"num_gpu_blocks_override": 0}, "num_gpu_blocks_override"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 2.5}, "max_num_batched_tokens"),
        ({"max_model_len": -1}, "max_model_len"),
        ({"block_size": 0}, "block_size"),
        ({"max_bad_word_len": 0}, "max_bad_word_len"),
        ({"enable_prefix_caching": 1}, "enable_prefix_caching"),
    ],
)
def test_engine_args_that_would_fall_back_silently_raise(kwargs, field):
    with pytest.raises(ValueError, match=f"EngineArgs: {field}"):
        EngineArgs(**kwargs)


def test_the_bad_word_length_limit_can_be_raised(llm):
    base = llm.generate("Tell me", GREEDY, use_tqdm=False)[0].outputs[0]
    word = base.text[1:11]  # ten characters: ten tokens of the built-in character tokenizer
    params = dataclasses.replace(GREEDY, bad_words=[word])
    with pytest.raises(ValueError, match="raise the engine argument max_bad_word_len"):
        llm.generate("Tell me", params, use_tqdm=False)
    with LLM(**ENGINE, max_bad_word_len=16) as roomy:
        banned = roomy.generate("Tell me", params, use_tqdm=False)[0].outputs[0]
    assert word in base.text and word not in banned.text and banned.text[:10] == base.text[:10]


def test_nan_logits_end_that_request_with_an_error_and_spare_the_others():
    def run(poison: bool):
        with LLM(**{**ENGINE, "model": str(TINY_LLAMA)}, skip_tokenizer_init=True) as llm:
            runner = llm.llm_engine.runner
            if poison:  # token 7's embedding is NaN: only a sequence holding it gets NaN logits
                runner.params = dict(runner.params, embed=runner.params["embed"].at[7].set(np.nan))
            params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
            chunked = [7] + list(range(10, 90))  # 81 tokens: its first chunk samples nothing
            return llm.generate([[3, 4, 5], [3, 7, 5], [9, 10], chunked], params, use_tqdm=False), llm.llm_engine.stats()

    (clean, bad, other, bad_chunked), stats = run(poison=True)
    (want_clean, _, want_other, _), _ = run(poison=False)
    for out in (bad, bad_chunked):
        assert out.outputs[0].finish_reason == "error" and out.outputs[0].token_ids == []
        assert "NaN" in out.error and out.outputs[0].num_nans_in_logits > 0
    assert stats.num_nans_in_logits == bad.outputs[0].num_nans_in_logits + bad_chunked.outputs[0].num_nans_in_logits
    for got, want in ((clean, want_clean), (other, want_other)):
        assert got.error is None and got.outputs[0].token_ids == want.outputs[0].token_ids


def test_a_schedule_that_fails_while_its_arrays_are_built_changes_nothing(monkeypatch):
    cfg, params = default_model()
    config = RunnerConfig(max_num_seqs=2, max_model_len=64, block_size=4, num_blocks=32)
    sampled = SamplingParams(temperature=1.0, max_tokens=None)  # unseeded: draws from the runner's seed

    def first_token(runner: Runner, state, rid: str) -> int:
        new = NewRequestData(rid, [5, 6, 7], ([0],), sampling_params=sampled)
        return runner.step(state, SchedulerOutput([new], num_scheduled_tokens={rid: 3}, total_num_scheduled_tokens=3))

    fresh = Runner(cfg, params, config)
    _, want = first_token(fresh, fresh.init_state(), "b")

    runner = Runner(cfg, params, config)
    state = runner.init_state()
    with monkeypatch.context() as m:
        m.setattr(jaxrunner.runner.plan, "build_inputs", lambda *a: (_ for _ in ()).throw(ValueError("broken")))
        with pytest.raises(ValueError, match="broken"):
            first_token(runner, state, "a")
    with pytest.raises(ValueError, match="num_scheduled_tokens must be integers"):
        new = NewRequestData("c", [5, 6, 7], ([0],), sampling_params=sampled)
        runner.step(state, SchedulerOutput([new], num_scheduled_tokens={"c": 2.5}, total_num_scheduled_tokens=2.5))
    _, got = first_token(runner, state, "b")
    assert got.sampled_token_ids == want.sampled_token_ids


def broken_checkpoints(root: Path) -> list[tuple[Path, str]]:
    """(checkpoint directory, what the one-line error must name) for each way a checkpoint breaks."""
    def copy(name: str) -> Path:
        path = root / name
        shutil.copytree(TINY_LLAMA, path)
        return path

    weights = "model.safetensors"
    cases = [(root / "missing", "does not exist")]
    path = copy("no-config")
    (path / "config.json").unlink()
    cases.append((path, "no config.json"))
    path = copy("bad-json")
    (path / "config.json").write_text("{not json")
    cases.append((path, "config.json"))
    path = copy("bad-field")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"hidden_size": "big"}))
    cases.append((path, "config.json"))
    path = copy("no-weights")
    (path / weights).unlink()
    cases.append((path, "no *.safetensors"))
    path = copy("truncated")
    data = (path / weights).read_bytes()
    (path / weights).write_bytes(data[: len(data) - 100])
    cases.append((path, weights))
    path = copy("bad-header")
    (path / weights).write_bytes(data[:8] + b"garbage!" + data[16:])
    cases.append((path, weights))
    path = copy("wrong-shape")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"intermediate_size": 2 * config["intermediate_size"]}))
    cases.append((path, "mis-shaped"))
    return cases


def test_a_broken_checkpoint_is_one_line_naming_the_file(tmp_path, capsys):
    for path, named in broken_checkpoints(tmp_path):
        with pytest.raises(SystemExit) as exit_info:
            main(["generate", "--model", str(path), "hi"])
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2, (path, err)
        assert len(err.splitlines()) == 1 and named in err and err.startswith("jaxrunner: error:"), (path, err)


def test_skip_tokenizer_init_takes_and_prints_token_ids(capsys):
    args = ["generate", "--model", str(TINY_LLAMA), "--skip-tokenizer-init", "--temperature", "0", "--max-tokens", "4",
            "--ignore-eos", "--max-model-len", "64", "3,4,5"]
    assert main(args) == 0
    with LLM(model=str(TINY_LLAMA), skip_tokenizer_init=True, max_model_len=64) as llm:
        want = llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert capsys.readouterr().out.strip() == f"Prompt: [3, 4, 5], Generated token ids: {want[0].outputs[0].token_ids} (length)"


def test_a_checkpoint_without_a_tokenizer_says_how_to_go_on(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(TINY_LLAMA), "hi"])
    assert "--skip-tokenizer-init" in capsys.readouterr().err


def test_engine_stats_count_what_happened():
    with LLM(**ENGINE, num_gpu_blocks_override=8) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
        llm.generate([f"Request {i}: tell me a story." for i in range(4)], params, use_tqdm=False)
        stats = llm.llm_engine.stats()
    assert stats.num_preemptions > 0 and stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0
    assert stats.prefix_cache_queries > 0 and stats.num_nans_in_logits == 0



def test_a_small_soak_loses_nothing_and_leaks_nothing():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from soak import soak
    finally:
        sys.path.pop(0)
    report = soak(num_requests=120, seed=1)
    assert report["ok"], report
    assert report["aborted"] > 0 and report["preemptions"] > 0



def test_the_stop_id_limit_counts_eos_when_the_request_arrives():
    """The request check and the schedule check agree (EOS counts under min_tokens), so an over-long
    list fails its own request when it arrives, never a whole schedule later."""
    cfg, params = default_model()  # EOS (2,)
    runner = Runner(cfg, params, RunnerConfig(max_num_seqs=2, max_model_len=64, block_size=4, num_blocks=32,
                                              sampler=SamplerConfig(max_stop_token_ids=3)))
    too_many = SamplingParams(min_tokens=1, stop_token_ids=[5, 6, 7])  # with EOS: 4 > 3
    with pytest.raises(ValueError, match="stop token ids"):
        runner.check_sampling_params(too_many)
    with pytest.raises(ValueError, match="stop token ids"):
        new = NewRequestData("a", [5, 6, 7], ([0],), sampling_params=too_many)
        runner.step(runner.init_state(), SchedulerOutput([new], num_scheduled_tokens={"a": 3}, total_num_scheduled_tokens=3))
    runner.check_sampling_params(dataclasses.replace(too_many, stop_token_ids=[5, 6]))
