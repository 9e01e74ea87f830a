"""Write tiny random Hugging Face checkpoints into tests/data/models/.

The CPU test suite has no torch, so these checkpoints (and the goldens made from
them by make_goldens.py) are committed. They are built with transformers' own
model classes and save_pretrained, so config.json and the safetensors layout are
exactly what a real checkpoint of that family looks like.

Needs torch + transformers (see tests/data/README.md). Run from the repo root:
    python scripts/make_tiny_models.py
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

import torch
import transformers

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "tests" / "data" / "models"

# Large init std so greedy top-1/top-2 margins are clear (checked by make_goldens.py).
WEIGHT_STD = 0.15
# Norm weights are 1 + noise and biases are noise, so a test fails if the JAX model
# drops a norm weight or a bias (HF's own init would make them 1 and 0).
NORM_STD = 0.1
BIAS_STD = 0.1

COMMON: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "initializer_range": WEIGHT_STD,
    "dtype": "float32",
}

# name -> (model class, config class, extra config, seed, save_pretrained kwargs).
# Seeds were picked so make_goldens.py's greedy-margin check passes.
# Intermediate sizes differ between models (and qwen3's head_dim != hidden/heads) so
# shape bugs that a single geometry would hide show up; the smaller ones keep the
# committed data small.
MODELS: dict[str, tuple[type, type, dict[str, Any], int, dict[str, Any]]] = {
    "tiny-llama": (
        transformers.LlamaForCausalLM,
        transformers.LlamaConfig,
        {
            "num_key_value_heads": 2,
            "intermediate_size": 128,
            "tie_word_embeddings": False,
            # head_dim 16 -> wavelengths 6, 32, 167, ...: below, inside and above
            # the [16, 64] band, so all three branches of llama3 scaling are used.
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
        5,
        {},
    ),
    "tiny-qwen2": (
        transformers.Qwen2ForCausalLM,
        transformers.Qwen2Config,
        {
            "num_key_value_heads": 1,
            "intermediate_size": 96,
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        0,
        {},
    ),
    "tiny-qwen3": (
        transformers.Qwen3ForCausalLM,
        transformers.Qwen3Config,
        {
            "num_key_value_heads": 2,
            "head_dim": 32,
            "intermediate_size": 64,
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        3,
        # Small shards so the checkpoint is split in two (covers sharded loading).
        {"max_shard_size": "300KB"},
    ),
    "tiny-mistral": (
        transformers.MistralForCausalLM,
        transformers.MistralConfig,
        {
            "num_key_value_heads": 2,
            "intermediate_size": 96,
            "tie_word_embeddings": False,
            # Prompts up to 40 tokens + 32 generated ones go well past the window.
            "sliding_window": 16,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
        0,
        {},
    ),
    "tiny-gemma2": (
        transformers.Gemma2ForCausalLM,
        transformers.Gemma2Config,
        {
            "num_key_value_heads": 2,
            "head_dim": 16,
            "intermediate_size": 96,
            "tie_word_embeddings": True,
            "hidden_activation": "gelu_pytorch_tanh",
            # Layer 0 slides over 16 keys, layer 1 sees all; the queries' scale is not head_dim's.
            "sliding_window": 16,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 24,
            # Caps low enough to bend the scores and logits these weights give.
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 10.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
        0,
        {},
    ),
    "tiny-gemma3": (
        transformers.Gemma3ForCausalLM,
        transformers.Gemma3TextConfig,
        {
            "num_key_value_heads": 1,
            "head_dim": 32,
            "intermediate_size": 64,
            "tie_word_embeddings": True,
            "hidden_activation": "gelu_pytorch_tanh",
            "sliding_window": 16,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 32,
            # Local and global layers rotate with their own bases; the global one is scaled linearly.
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 4.0},
            },
        },
        0,
        {},
    ),
    "tiny-qwen3-moe": (
        transformers.Qwen3MoeForCausalLM,
        transformers.Qwen3MoeConfig,
        {
            "num_key_value_heads": 2,
            "head_dim": 16,
            "intermediate_size": 96,  # of dense layers, which this model has none of
            "moe_intermediate_size": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        0,
        {},
    ),
    "tiny-mixtral": (
        transformers.MixtralForCausalLM,
        transformers.MixtralConfig,
        {
            "num_key_value_heads": 2,
            "intermediate_size": 48,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        2,
        {},
    ),
}


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter from one seeded generator, independent of HF's init."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # named_parameters() lists a tied embedding / lm_head once.
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if param.ndim >= 2:
                param.copy_(noise * WEIGHT_STD)
            elif name.endswith(".bias"):
                param.copy_(noise * BIAS_STD)
            else:  # RMSNorm weights (layer norms, final norm, q/k norms; Gemma's scale by 1 + weight)
                param.copy_(1.0 + noise * NORM_STD)


def build(name: str) -> torch.nn.Module:
    """Build one tiny model with random weights, in float32 and eager attention."""
    model_cls, config_cls, extra, seed, _ = MODELS[name]
    config = config_cls(**COMMON, **extra)
    config.architectures = [model_cls.__name__]
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    randomize_(model, seed)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--only", nargs="*", default=sorted(MODELS), help="model names")
    args = parser.parse_args()
    torch.set_num_threads(1)

    for name in args.only:
        out_dir = args.out / name
        if out_dir.exists():
            shutil.rmtree(out_dir)  # stale shards must not survive a re-run
        model = build(name)
        model.save_pretrained(out_dir, safe_serialization=True, **MODELS[name][4])
        files = sorted(p.name for p in out_dir.iterdir())
        size = sum(p.stat().st_size for p in out_dir.iterdir())
        print(f"{name}: {size / 1024:.0f} KiB {files}")


if __name__ == "__main__":
    main()
