"""Config parsing and checkpoint loading, including the errors a user sees for a bad checkpoint."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import pytest
from safetensors.numpy import load_file, save_file

from jaxrunner.config import ModelConfig
from jaxrunner.checkpoints.loader import load_model

MODELS = Path(__file__).parent / "data" / "models"


def test_configs_of_each_family():
    llama = ModelConfig.from_hf(MODELS / "tiny-llama")
    assert llama.rope_scaling is not None and llama.rope_scaling.factor == 8.0
    assert (llama.num_heads, llama.num_kv_heads, llama.tie_word_embeddings) == (4, 2, False)
    qwen2 = ModelConfig.from_hf(MODELS / "tiny-qwen2")
    assert qwen2.qkv_bias and qwen2.tie_word_embeddings and not qwen2.qk_norm and qwen2.sliding_window is None
    qwen3 = ModelConfig.from_hf(MODELS / "tiny-qwen3")
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.hidden_size // qwen3.num_heads == 16
    mistral = ModelConfig.from_hf(MODELS / "tiny-mistral")
    assert mistral.sliding_window == 16 and mistral.eos_token_ids == (2,)
    assert mistral.layer_types == () and mistral.layer_window(1) == 16 and not mistral.gemma
    gemma2 = ModelConfig.from_hf(MODELS / "tiny-gemma2")
    assert gemma2.gemma and (gemma2.attn_soft_cap, gemma2.final_soft_cap, gemma2.query_pre_attn_scalar) == (5.0, 10.0, 24)
    assert [gemma2.layer_window(i) for i in range(2)] == [16, None] and gemma2.hidden_act == "gelu_pytorch_tanh"
    gemma3 = ModelConfig.from_hf(MODELS / "tiny-gemma3")
    assert gemma3.qk_norm and gemma3.final_soft_cap is None
    assert (gemma3.rope_theta, gemma3.local_rope_theta, gemma3.rope_linear_factor) == (1e6, 1e4, 4.0)


def test_bad_gemma_configs_are_refused(tmp_path):
    path = copy_of(tmp_path, "tiny-gemma3")
    config = json.loads((path / "config.json").read_text())
    gemma3 = ModelConfig.from_hf(path)
    with pytest.raises(ValueError, match="layer_types must name 2 layers"):
        dataclasses.replace(gemma3, layer_types=("sliding_attention",))
    with pytest.raises(ValueError, match="sliding_window is not set"):
        dataclasses.replace(gemma3, sliding_window=None)
    for edit, error in [({"hidden_activation": "relu"}, "unsupported hidden activation 'relu'"),
                        ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}},
                         "unsupported rope_type 'yarn'")]:
        (path / "config.json").write_text(json.dumps(config | edit))
        with pytest.raises(ValueError, match=error):
            ModelConfig.from_hf(path)


def test_loads_in_the_requested_dtype():
    cfg, params = load_model(MODELS / "tiny-qwen3", "bfloat16")
    assert params["embed"].dtype == jnp.bfloat16 and "lm_head" not in params
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    assert params["layers"][1]["wqkv"].shape == (cfg.hidden_size, q + 2 * kv)


def copy_of(tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name
    shutil.copytree(MODELS / name, dst)
    return dst


def test_missing_directory():
    with pytest.raises(ValueError, match="does not exist"):
        load_model("/nonexistent/model")


def test_directory_without_config(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_model(tmp_path)


def test_unsupported_architecture(tmp_path):
    path = copy_of(tmp_path, "tiny-llama")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture.*LlamaForCausalLM"):
        load_model(path)


def rewrite_weights(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


def test_missing_tensor_is_named(tmp_path):
    path = copy_of(tmp_path, "tiny-llama")
    rewrite_weights(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(path)


def test_misshaped_tensor_is_named(tmp_path):
    path = copy_of(tmp_path, "tiny-llama")
    rewrite_weights(path, lambda t: t.update({"model.norm.weight": t["model.norm.weight"][:10]}))
    with pytest.raises(ValueError, match=r"mis-shaped.*model\.norm\.weight: expected \(64,\), got \(10,\)"):
        load_model(path)


def test_no_safetensors(tmp_path):
    path = copy_of(tmp_path, "tiny-llama")
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_model(path)


def test_misshaped_part_of_a_fused_tensor_is_named(tmp_path):
    path = copy_of(tmp_path, "tiny-llama")
    rewrite_weights(path, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": t["model.layers.0.self_attn.q_proj.weight"]}))
    with pytest.raises(ValueError, match=r"mis-shaped.*model\.layers\.0\.self_attn\.k_proj\.weight: expected \(32, 64\), got \(64, 64\)"):
        load_model(path)
