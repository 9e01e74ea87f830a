"""The device memory a runner takes, known before it exists: the engine sizes the KV cache from these
(`engine_args`), so the sizes of the pages (`state.init_state`), of the split (`parallel`) and of
the LoRA slots (`lora.slots`) are read here, next to what they size, and nowhere in the engine."""

from __future__ import annotations

import dataclasses

import jax

from jaxrunner.config import ModelConfig, RunnerConfig
from jaxrunner.lora.slots import lora_structs
from jaxrunner.runner.parallel import sharded_config


def kv_cache_bytes(model: ModelConfig, cfg: RunnerConfig, draft: ModelConfig | None = None) -> int:
    """Bytes of the KV cache: the model's, plus the draft model's (it shares the pages' block ids)."""
    def per_model(m: ModelConfig) -> int:
        return 2 * cfg.num_blocks * cfg.block_size * m.num_kv_heads * m.head_dim * m.group_size

    return (per_model(model) + (per_model(draft) if draft is not None else 0)) * cfg.kv_dtype.itemsize


def bytes_per_block(model: ModelConfig, cfg: RunnerConfig, draft: ModelConfig | None = None) -> int:
    """Bytes one KV block takes on each device: the target's pages and the draft's, under tensor
    parallelism 1 / tp of the pages of the model as the shards run it (at least a KV head each)."""
    tp = cfg.tensor_parallel_size
    return kv_cache_bytes(sharded_config(model, tp), dataclasses.replace(cfg, num_blocks=1), draft) // tp


def lora_bytes(model: ModelConfig, cfg: RunnerConfig) -> int:
    """Device bytes of the LoRA slots (0 without LoRA); the runner allocates them after the KV cache
    is sized, so the sizing sets them aside."""
    return sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(lora_structs(model, cfg.lora, cfg.dtype)))
