"""Sampling defaults from the model (vLLM's `generation_config`): a checkpoint's generation_config.json
fills what a request leaves out, in `LLM`, the CLI and the server, and a request's own values win;
"vllm" ignores the file; a malformed one is a one-line error naming it. And `jaxrunner chat`'s
/params, /temperature and dropping the oldest turns to stay within the model's context."""

from __future__ import annotations

import io
import json
import logging
import re
import shutil
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from jaxrunner import LLM, SamplingParams
from jaxrunner.cli import main
from jaxrunner.engine.default_model import default_tokenizer
from jaxrunner.engine.generation_config import sampling_defaults
from jaxrunner.server.api_server import build_app
from jaxrunner.server.async_llm import AsyncLLM
from jaxrunner.server.metrics import ServerMetrics
from jaxrunner.server.protocol import ChatCompletionRequest, CompletionRequest

TINY_LLAMA = Path(__file__).parent / "data" / "models" / "tiny-llama"
SMALL = ["--max-model-len", "64", "--max-num-seqs", "2", "--max-num-batched-tokens", "32"]
ENGINE = {"max_model_len": 64, "max_num_seqs": 2, "max_num_batched_tokens": 32}
FILE = {"temperature": 0.0, "top_k": 5, "repetition_penalty": 1.3, "max_new_tokens": 5, "do_sample": True}
DEFAULTS = SamplingParams(temperature=0.0, top_k=5, repetition_penalty=1.3, max_tokens=5)
TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny Llama with the built-in tokenizer, a chat template, and sampling fields in its
    generation_config.json (the file it ships with has none)."""
    path = tmp_path_factory.mktemp("model")
    for f in TINY_LLAMA.iterdir():
        shutil.copy(f, path)
    tokenizer = default_tokenizer()
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    shipped = json.loads((TINY_LLAMA / "generation_config.json").read_text())
    assert not set(shipped) & set(FILE)
    (path / "generation_config.json").write_text(json.dumps({**shipped, **FILE}))
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(str(model_dir), **ENGINE) as llm:
        yield llm


def test_llm_requests_without_params_take_the_model_defaults(llm):
    assert llm.get_default_sampling_params() == DEFAULTS
    (out,) = llm.generate("Hello", use_tqdm=False)
    (same,) = llm.generate("Hello", DEFAULTS, use_tqdm=False)
    assert out.outputs[0].token_ids == same.outputs[0].token_ids
    (own,) = llm.generate("Hello", SamplingParams(max_tokens=7, ignore_eos=True), use_tqdm=False)
    assert len(own.outputs[0].token_ids) == 7  # a request's own params: none of the defaults


def test_vllm_mode_ignores_the_file_and_a_directory_brings_one(model_dir, tmp_path):
    assert sampling_defaults("vllm", str(model_dir), built_in=False) == {}
    assert sampling_defaults("auto", str(TINY_LLAMA), built_in=False) == {}  # a file without sampling fields
    (tmp_path / "generation_config.json").write_text('{"top_p": 0.5, "min_p": null}')
    assert sampling_defaults(str(tmp_path), str(model_dir), built_in=False) == {"top_p": 0.5}
    with pytest.raises(ValueError, match="holds no generation_config.json"):
        sampling_defaults(str(TINY_LLAMA.parent), None, built_in=False)


@pytest.mark.parametrize(("text", "words"), [
    ("{", "Expecting"),
    ("[0.5]", "not a JSON object"),
    ('{"temperature": -1}', "temperature must be >= 0"),
    ('{"top_p": "high"}', "top_p must be a finite number"),
])
def test_a_malformed_generation_config_is_a_one_line_error_naming_the_file(model_dir, tmp_path, capsys, text, words):
    path = tmp_path / "generation_config.json"
    path.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", str(model_dir), *SMALL, "--generation-config", str(tmp_path), "x"])
    (line,) = capsys.readouterr().err.splitlines()
    assert exit_info.value.code == 2 and str(path) in line and words in line and "--generation-config vllm" in line


def generated_ids(capsys) -> list[list[int]]:
    return [json.loads(ids) for ids in re.findall(r"Generated token ids: (\[.*?\])", capsys.readouterr().out)]


def test_cli_flags_left_out_take_the_model_defaults(model_dir, capsys, caplog):
    base = ["generate", "--model", str(model_dir), *SMALL, "--skip-tokenizer-init", "--ignore-eos"]
    with caplog.at_level(logging.WARNING, logger="jaxrunner.engine.generation_config"):
        assert main([*base, "1,2,3"]) == 0
    (record,) = [r for r in caplog.records if r.name == "jaxrunner.engine.generation_config"]
    assert str(model_dir / "generation_config.json") in record.getMessage()
    assert "temperature=0.0, top_k=5, repetition_penalty=1.3, max_tokens=5" in record.getMessage()
    (defaulted,) = generated_ids(capsys)
    assert main([*base, "--temperature", "0", "--top-k", "5", "--repetition-penalty", "1.3", "--max-tokens", "5",
                 "1,2,3"]) == 0
    assert generated_ids(capsys) == [defaulted] and len(defaulted) == 5
    assert main([*base, "--max-tokens", "7", "1,2,3"]) == 0
    assert [len(ids) for ids in generated_ids(capsys)] == [7]
    assert main([*base, "--generation-config", "vllm", "1,2,3"]) == 0
    assert [len(ids) for ids in generated_ids(capsys)] == [16]  # SamplingParams' max_tokens


def test_server_fields_left_out_take_the_model_defaults(llm):
    defaults = llm.llm_engine.sampling_defaults
    messages = [{"role": "user", "content": "Hi"}]
    assert ChatCompletionRequest(messages=messages).to_sampling_params(defaults) == DEFAULTS
    assert ChatCompletionRequest(messages=messages, temperature=0.5, max_completion_tokens=9).to_sampling_params(
        defaults) == SamplingParams(temperature=0.5, top_k=5, repetition_penalty=1.3, max_tokens=9)
    assert CompletionRequest(prompt="Hi", top_k=-1).to_sampling_params(defaults) == SamplingParams(
        temperature=0.0, repetition_penalty=1.3, max_tokens=5)
    assert CompletionRequest(prompt="Hi").to_sampling_params({}) == SamplingParams(max_tokens=16)  # OpenAI's
    assert ChatCompletionRequest(messages=messages).to_sampling_params({}).max_tokens is None  # the room left

    (expected,) = llm.generate("Hello", DEFAULTS, use_tqdm=False)
    # One live request through the routes; the server closes the engine when it stops, so this runs last.
    app = build_app(AsyncLLM(llm.llm_engine), ServerMetrics("tiny"), "tiny")
    with TestClient(app) as client:
        reply = client.post("/v1/completions", json={"prompt": "Hello"}).json()
    assert reply["choices"][0]["text"] == expected.outputs[0].text
    assert reply["usage"]["completion_tokens"] == len(expected.outputs[0].token_ids)


def chat(model_dir, monkeypatch, lines: str, *flags: str) -> int:
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    return main(["chat", "--model", str(model_dir), *SMALL, *flags])


def test_chat_shows_and_changes_the_sampling_settings(model_dir, monkeypatch, capsys):
    assert chat(model_dir, monkeypatch, "/params\n/temperature 0.5\n/top-k x\n/temperature -1\n/nope\n/exit\n") == 0
    captured = capsys.readouterr()
    shown = [line.removeprefix("> ") for line in captured.out.splitlines() if "temperature=" in line]
    assert shown == ["temperature=0.0 top_p=1.0 top_k=5 min_p=0.0 repetition_penalty=1.3 max_tokens=5",
                     "temperature=0.5 top_p=1.0 top_k=5 min_p=0.0 repetition_penalty=1.3 max_tokens=5"]
    assert "/top_k: invalid literal" in captured.err and "/temperature: SamplingParams: temperature must be >= 0" in captured.err
    assert "commands: /params, /NAME VALUE for NAME in temperature, top_p, top_k, min_p, repetition_penalty, max_tokens" in captured.err


def test_chat_drops_the_oldest_turns_to_stay_within_the_context(model_dir, monkeypatch, capsys):
    # A turn renders to 28 tokens and its reply takes 8 of the 64: the second turn leaves no room for the first.
    assert chat(model_dir, monkeypatch, "0123456789\nabcdefghij\n", "--max-tokens", "8", "--ignore-eos") == 0
    captured = capsys.readouterr()
    assert "[dropped the oldest 1 turn(s)" in captured.err and "error" not in captured.err
    assert len(captured.out.split("> ")) == 4  # two replies, then the prompt that met the end of input
