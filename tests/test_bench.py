"""`jaxrunner bench latency` / `throughput` on the tiny shape, and the transformers peer's model config."""

from __future__ import annotations

import dataclasses
import json

import jax
import pytest
from transformers import AutoConfig

from jaxrunner.bench.floors import weight_bytes_per_step
from jaxrunner.bench.latency import hf_config
from jaxrunner.cli import main
from jaxrunner.config import ModelConfig
from jaxrunner.checkpoints.dummy import SHAPES, random_params


@pytest.fixture(autouse=True)
def no_out_dir(monkeypatch):
    monkeypatch.delenv("OUT", raising=False)


def _bench(tmp_path, capsys, *args: str) -> tuple[dict, str]:
    path = tmp_path / "result.json"
    assert main(["bench", *args, "--shape", "tiny", "--no-peer", "--json", str(path)]) == 0
    return json.loads(path.read_text()), capsys.readouterr().out


def test_latency(tmp_path, capsys):
    result, out = _bench(tmp_path, capsys, "latency", "--prompt", "8", "--new", "8", "--iters", "1")
    assert result["args"] == dict(shape="tiny", prompt=8, new=8, iters=1, num_scheduler_steps=8,
                                  async_scheduling=True, seed=0)
    assert result["device"] and result["dtype"] == "float32"
    assert result["ttft_ms"] > 0 and result["decode_ms_per_step"] > 0 and len(result["decode_ms_per_step_all"]) == 1
    assert result["floor_ms"] > 0 and result["fraction_of_floor"] == result["floor_ms"] / result["decode_ms_per_step"]
    assert result["peer"] == {"skipped": "--no-peer"} and "speedup_vs_peer" not in result
    assert "ms per decode step" in out and "skipped (--no-peer)" in out
    int4, _ = _bench(tmp_path, capsys, "latency", "--prompt", "8", "--new", "8", "--iters", "1", "--quantization", "int4")
    assert int4["args"]["quantization"] == "int4" and int4["decode_ms_per_step"] > 0
    assert int4["floor_ms"] < 0.8 * result["floor_ms"]  # its projections read in 4 bits (and their scales)


def test_latency_with_an_oracle_accepts_every_draft(tmp_path, capsys):
    result, out = _bench(tmp_path, capsys, "latency", "--prompt", "8", "--new", "16", "--iters", "1", "--oracle", "3")
    spec = result["spec_decoding"]
    assert result["args"]["num_scheduler_steps"] == 1 and result["args"]["oracle"] == 3
    assert spec["num_draft_tokens"] > 0 and spec["acceptance_rate_per_position"][0] == 1.0
    assert "speculative decoding:" in out and "accepted" in out


def test_throughput_with_ngram_drafts_reports_them(tmp_path, capsys):
    config = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}'
    args = ["throughput", "--num-prompts", "3", "--min-prompt", "5", "--max-prompt", "12", "--new", "8"]
    result, out = _bench(tmp_path, capsys, *args, "--speculative-config", config)
    assert result["output_tokens"] == 3 * 8 and result["spec_decoding"]["num_draft_tokens"] > 0
    assert "speculative decoding:" in out


def test_throughput(tmp_path, capsys):
    args = ["throughput", "--num-prompts", "4", "--min-prompt", "5", "--max-prompt", "20", "--new", "8"]
    result, out = _bench(tmp_path, capsys, *args, "--num-scheduler-steps", "1", "--no-async-scheduling")
    assert result["args"]["num_scheduler_steps"] == 1 and result["args"]["async_scheduling"] is False
    assert result["output_tokens"] == 4 * 8 and 4 * 5 <= result["prompt_tokens"] <= 4 * 20
    assert result["elapsed_s"] > 0 and result["tokens_per_s"] == result["output_tokens"] / result["elapsed_s"]
    assert "output tokens/s" in out


def test_bad_sizes_exit_with_a_message(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "latency", "--shape", "tiny", "--new", "1", "--no-peer"])
    assert exit_info.value.code == 2 and "new >= 2" in capsys.readouterr().err


@pytest.mark.parametrize(
    "model",
    [*SHAPES.values(), dataclasses.replace(SHAPES["tiny"], architecture="MistralForCausalLM", sliding_window=64)],
)
def test_hf_config_describes_the_same_model(model):
    """The peer builds its model from this dict: read back the way a checkpoint's config is, it is the shape."""
    config = hf_config(model)
    assert json.loads(json.dumps(config)) == config
    assert ModelConfig.from_hf_config(AutoConfig.for_model(**config)) == model


def test_peer_on_the_tiny_shape():
    """The transformers peer end to end (float32 on CPU when torch has no GPU: `allow_cpu`)."""
    pytest.importorskip("torch")
    from jaxrunner.bench import hf_peer

    spec = dict(config=hf_config(SHAPES["tiny"]), new=4, seed=0, compile=False, allow_cpu=True)
    latency = hf_peer.measure(dict(spec, workload="latency", prompts=[[1, 2, 3, 4, 5]] * 2))
    assert latency["decode_ms_per_step"] > 0 and latency["ttft_ms"] > 0
    throughput = hf_peer.measure(dict(spec, workload="throughput", prompts=[[1, 2, 3], [4, 5, 6, 7, 8]]))
    assert throughput["output_tokens"] == 2 * 4 and throughput["tokens_per_s"] > 0


def test_the_floor_counts_the_experts_a_step_reads():
    """The Qwen3-30B-A3B shape's weights as structs: at batch 1 a step reads 8 of 128 experts per
    layer, so its floor is about the 3.3B active parameters' bytes, not the 30B of every expert; at
    a large batch nearly every expert is read."""
    cfg = SHAPES["qwen3-30b-a3b"]
    params = jax.eval_shape(lambda: random_params(cfg, "bfloat16", 0))
    every = sum(x.size * 2 for x in jax.tree.leaves(params)) - (0 if cfg.tie_word_embeddings else params["embed"].size * 2)
    one = weight_bytes_per_step(params, 1, cfg.num_experts_per_tok)
    assert 6.0e9 < one < 7.0e9 < every  # 3.3B active parameters in bf16
    experts = sum(p[name].size * 2 for p in params["layers"] for name in ("experts_gate_up", "experts_down"))
    assert one == pytest.approx(every - experts * (1 - 8 / 128), rel=1e-9)
    assert weight_bytes_per_step(params, 4096, cfg.num_experts_per_tok) == pytest.approx(every, rel=1e-6)
