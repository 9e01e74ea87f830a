"""Random weights in a model's shape, for `load_format="dummy"`, the built-in tiny model and the
benchmarks; and real models' shapes by name (W1 is Llama-3-8B's, W2 Qwen3-0.6B's; docs/design.md).
Beside the checkpoint readers, so that the engine gets weights of either kind from `checkpoints`
and never reaches into `models` itself."""

from __future__ import annotations

import os

import jax

from jaxrunner.config import ModelConfig, RopeScaling
from jaxrunner.models.llama import Params, init_params

SHAPES = {
    "llama3-8b": ModelConfig(
        "LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192), max_position_embeddings=131072, eos_token_ids=(128001,),
    ),
    "qwen3-0.6b": ModelConfig(
        "Qwen3ForCausalLM", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
        num_heads=16, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, tie_word_embeddings=True, qk_norm=True, eos_token_ids=(151645,),
    ),
    "qwen3-30b-a3b": ModelConfig(
        "Qwen3MoeForCausalLM", vocab_size=151936, hidden_size=2048, intermediate_size=768, num_layers=48,
        num_heads=32, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, qk_norm=True, num_experts=128, num_experts_per_tok=8, eos_token_ids=(151645,),
    ),
    "tiny": ModelConfig(
        "LlamaForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, eos_token_ids=(0,),
    ),
}


def shape(name: str) -> ModelConfig:
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; choose one of {', '.join(SHAPES)}")
    return SHAPES[name]


def random_params(config: ModelConfig, dtype: str, seed: int, std: float = 0.02) -> Params:
    """Normal weights of standard deviation `std` (norm weights ones), the same for a seed on every
    machine."""
    return init_params(config, jax.random.key(seed), dtype, std=std)


def dummy_config(model: str) -> ModelConfig:
    """The shape of `model` for `load_format="dummy"`: a checkpoint directory's (only its config.json
    is read) or a name in SHAPES."""
    return ModelConfig.from_hf(model) if os.path.isdir(model) else shape(model)
