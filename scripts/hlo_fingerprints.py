"""Fingerprint every program a runner compiles: one line per program, its key and a hash of its
lowered StableHLO. Run it before and after a change that should leave the device side alone (a
refactor of the host side), and diff the two files.

    python scripts/hlo_fingerprints.py OUT.json

Covers the Llama family (and Gemma 3, Mixtral) under the runner configurations that change which
programs exist: plain, multi-step, n-gram and draft-model speculation, LoRA, prompt logprobs with
bad words, the Pallas kernels (interpreted) and an fp8 KV cache. Lowering only, no compile.
"""

from __future__ import annotations

import hashlib
import json
import sys

import jax

from jaxrunner.config import LoraConfig, RunnerConfig, SpeculativeConfig
from jaxrunner.checkpoints.loader import load_model
from jaxrunner.runner import Runner

MODELS = "tests/data/models"

CONFIGS = {
    "plain": RunnerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, num_blocks=64),
    "multistep": RunnerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, num_blocks=64,
                              num_scheduler_steps=4),
    "ngram": RunnerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, num_blocks=64,
                          speculative=SpeculativeConfig(num_speculative_tokens=3)),
    "lora": RunnerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, num_blocks=64,
                         lora=LoraConfig(max_loras=2, max_lora_rank=8)),
    "pallas_fp8": RunnerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, num_blocks=64,
                               kernels="pallas", kv_cache_dtype="fp8", num_scheduler_steps=2),
}


def fingerprints(runner: Runner) -> dict[str, str]:
    programs = runner.programs
    out = {}
    for program in programs.warmup_programs():
        text = programs._lower(program).as_text(debug_info=False)
        out[repr(program.key)] = hashlib.sha256(text.encode()).hexdigest()[:16]
    return out


def main(path: str) -> None:
    result = {}
    for model_name in ("tiny-llama", "tiny-qwen3", "tiny-gemma3", "tiny-qwen3-moe"):
        model, params = load_model(f"{MODELS}/{model_name}")
        for name, cfg in CONFIGS.items():
            if name == "lora" and model.num_experts:
                continue
            result[f"{model_name}/{name}"] = fingerprints(Runner(model, params, cfg))
            print(model_name, name, len(result[f"{model_name}/{name}"]), flush=True)
    draft_model, draft_params = load_model(f"{MODELS}/tiny-llama")
    model, params = load_model(f"{MODELS}/tiny-llama")
    cfg = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, num_blocks=64,
                       speculative=SpeculativeConfig(method="draft_model", num_speculative_tokens=2, model="draft"))
    result["tiny-llama/draft"] = fingerprints(Runner(model, params, cfg, draft=(draft_model, draft_params)))
    with open(path, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    print(sum(map(len, result.values())), "programs", jax.__version__)


if __name__ == "__main__":
    main(sys.argv[1])
