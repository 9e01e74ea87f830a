"""Hugging Face Hub ids resolve through huggingface_hub's cache (a prepared cache directory here,
never the network), HF_HUB_OFFLINE honoured, and a model that is nowhere gets one line saying what
to download."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import constants

from jaxrunner import LLM, SamplingParams
from jaxrunner.engine.default_model import default_tokenizer
from jaxrunner.engine.model_files import hub_snapshot

TINY_LLAMA = Path(__file__).parent / "data" / "models" / "tiny-llama"
REPO = "jaxrunner-tests/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture()
def hub_cache(tmp_path, monkeypatch) -> Path:
    """A Hub cache as huggingface_hub lays it out, holding REPO's main revision."""
    cache = tmp_path / "hub"
    repo = cache / f"models--{REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(TINY_LLAMA, snapshot)
    default_tokenizer().save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_hub_id_loads_from_the_cache(hub_cache):
    assert hub_snapshot(REPO) == str(hub_cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(REPO, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32) as from_hub:
        assert from_hub.llm_engine.args.model.endswith(COMMIT)
        got = from_hub.generate("Hello", greedy, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(str(TINY_LLAMA), tokenizer=from_hub.llm_engine.args.model, max_model_len=64, max_num_seqs=2,
             max_num_batched_tokens=32) as local:
        assert got == local.generate("Hello", greedy, use_tqdm=False)[0].outputs[0].token_ids


def test_a_model_in_no_cache_offline_says_what_to_download(hub_cache):
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE is set") as info:
        LLM("jaxrunner-tests/absent")
    assert "hf download jaxrunner-tests/absent" in str(info.value) and "\n" not in str(info.value)


def test_the_cli_honours_the_hub_environment(hub_cache):
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_CACHE=str(hub_cache), HF_HUB_OFFLINE="1")
    args = ["generate", "--model", REPO, "--max-model-len", "64", "--max-num-seqs", "2", "--max-num-batched-tokens",
            "32", "--max-tokens", "3", "Hi"]
    done = subprocess.run([sys.executable, "-m", "jaxrunner.cli", *args], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("Prompt: 'Hi', Generated text: "), done.stderr
    absent = subprocess.run([sys.executable, "-m", "jaxrunner.cli", *args[:2], "jaxrunner-tests/absent", *args[3:]],
                            capture_output=True, text=True, env=env, timeout=300)
    assert absent.returncode == 2 and absent.stderr.count("\n") == 1 and "HF_HUB_OFFLINE" in absent.stderr


def test_no_network_says_what_to_download(hub_cache, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def unreachable(repo_id, local_files_only=False, **kwargs):
        if local_files_only:
            raise LocalEntryNotFoundError("not cached")
        raise ConnectionError("the Hub cannot be reached")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(ValueError, match="downloading it failed") as info:
        hub_snapshot("jaxrunner-tests/absent")
    assert "hf download jaxrunner-tests/absent" in str(info.value) and "\n" not in str(info.value)
