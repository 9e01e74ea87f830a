"""The `jaxrunner generate` command on a local checkpoint: sampling flags, streaming, logprobs, errors (the README's
first command is in test_default_model.py)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

import jaxrunner.engine.llm
from jaxrunner.cli import main
from jaxrunner.engine.default_model import default_tokenizer

TINY_LLAMA = Path(__file__).parent / "data" / "models" / "tiny-llama"
SMALL = ["--max-model-len", "64", "--max-num-seqs", "2", "--max-num-batched-tokens", "32"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A local HF checkpoint with a tokenizer: the tiny Llama weights plus the built-in tokenizer."""
    path = tmp_path_factory.mktemp("model")
    for f in TINY_LLAMA.iterdir():
        shutil.copy(f, path)
    default_tokenizer().save_pretrained(path)
    return path


def test_local_checkpoint_with_sampling_flags(model_dir, capsys):
    args = ["generate", "--model", str(model_dir), *SMALL, "--temperature", "0", "--max-tokens", "6", "--n", "2"]
    assert main([*args, "--ignore-eos", "one", "two"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and lines[0].startswith("Prompt: 'one', Generated text [0]: ")
    assert lines[0].split(": ", 2)[2] == lines[1].split(": ", 2)[2]  # greedy: both completions agree
    assert all(line.endswith("(length)") for line in lines)


def test_stream_prints_the_same_text(model_dir, capsys):
    base = [
        "generate",
        "--model",
        str(model_dir),
        *SMALL,
        "--temperature",
        "0",
        "--max-tokens",
        "8",
        "--ignore-eos",
        "hi",
    ]
    assert main(base) == 0
    text = eval(capsys.readouterr().out.split("Generated text: ", 1)[1].rsplit(" (", 1)[0])
    assert main([*base, "--stream"]) == 0
    assert capsys.readouterr().out == text + "\n"


def test_logprobs_print_one_line_per_token(model_dir, capsys):
    base = ["generate", "--model", str(model_dir), *SMALL, "--temperature", "0", "--max-tokens", "3", "--ignore-eos"]
    assert main([*base, "--logprobs", "2", "--prompt-logprobs", "1", "hi"]) == 0
    lines = capsys.readouterr().out.splitlines()
    prompt_lines = len(default_tokenizer().encode("hi")) - 1  # the first prompt token has no logprob
    assert lines[0] == "Prompt logprobs of 'hi':" and lines[prompt_lines + 2] == "Logprobs:"
    assert len(lines) == 1 + prompt_lines + 2 + 3
    assert all(re.fullmatch(r"  '.*' -?\d+\.\d{4} \(rank 1\) \| '.*' -?\d+\.\d{4}", line) for line in lines[-3:])
    assert main([*base, "--logprobs", "2", "--prompt-logprobs", "1", "--stream", "hi"]) == 0
    streamed = capsys.readouterr().out.splitlines()
    assert streamed[2:] == lines[1 : prompt_lines + 1] + lines[-4:]  # after the text and "Prompt logprobs:"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--stream", "x", "y"], "--stream"),
        (["--temperature", "-1", "x"], "temperature"),
        (["caf\udce9"], "not valid Unicode"),  # a Latin-1 argument: Python reads its byte as a lone surrogate
    ],
)
def test_bad_requests_exit_with_a_message(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", *SMALL, *args])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_too_long_prompt_is_reported(model_dir, capsys):
    assert main(["generate", "--model", str(model_dir), *SMALL, "--max-tokens", "2", "ok", "y" * 80]) == 1
    captured = capsys.readouterr()
    assert "Prompt: 'ok'" in captured.out and "maximum model length of 64" in captured.err


def test_structured_output_flags(model_dir, tmp_path, capsys):
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"k": {"enum": ["aa", "bb"]}}, "required": ["k"], '
                      '"additionalProperties": false}')
    base = ["generate", "--model", str(model_dir), *SMALL, "--temperature", "0", "--max-tokens", "40"]
    assert main([*base, "--json-schema", f"@{schema}", "--no-enable-prefix-caching", "x"]) == 0
    text = capsys.readouterr().out.split("Generated text: ", 1)[1].rsplit(" (", 1)[0]
    assert json.loads(eval(text))["k"] in ("aa", "bb")
    assert main([*base, "--choice", "left", "--choice", "right", "x"]) == 0
    assert re.search(r"Generated text: '(left|right)' \(stop\)", capsys.readouterr().out)
    with pytest.raises(SystemExit):
        main([*base, "--regex", "a", "--choice", "b", "x"])
    assert "exactly one of" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*base, "--json-schema", "@/no/such/file", "x"])
    assert "cannot read" in capsys.readouterr().err


@pytest.mark.parametrize("flags, eager", [([], True), (["--no-enforce-eager"], False), (["--enforce-eager"], True)])
def test_generate_compiles_only_what_its_prompts_use_unless_told(monkeypatch, flags, eager):
    """A one-shot command: its few prompts use a few buckets, which compile when first used, rather
    than every bucket at start-up (the engine's default on a GPU)."""
    seen = {}

    class Opened(Exception):
        pass

    def opened(**kwargs):
        seen.update(kwargs)
        raise Opened

    monkeypatch.setattr(jaxrunner.engine.llm, "LLM", opened)
    with pytest.raises(Opened):
        main(["generate", *flags, "hi"])
    assert seen["enforce_eager"] is eager
