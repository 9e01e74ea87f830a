"""Load a local Hugging Face checkpoint (config.json + one or many *.safetensors) into a params pytree."""

from __future__ import annotations

import glob
import json
import os

import jax.numpy as jnp
from safetensors import safe_open

from jaxrunner.config import ModelConfig
from jaxrunner.models.llama import Params, param_shapes

# Our name -> (Hugging Face name, stored transposed?). HF linear weights are [out, in]; ours are [in, out].
_LAYER_NAMES = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "bq": ("self_attn.q_proj.bias", False),
    "bk": ("self_attn.k_proj.bias", False),
    "bv": ("self_attn.v_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}
_TOP_NAMES = {
    "embed": ("model.embed_tokens.weight", False),
    "final_norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}


def load_model(path: str | os.PathLike, dtype: str = "float32") -> tuple[ModelConfig, Params]:
    """Read the config and every weight of a local checkpoint directory, cast to `dtype`."""
    cfg = ModelConfig.from_hf(path)
    return cfg, load_params(path, cfg, dtype)


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, n) for n in names]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {path!r}: only safetensors checkpoints are supported")
    return files


def load_params(path: str | os.PathLike, cfg: ModelConfig, dtype: str = "float32") -> Params:
    path = os.fspath(path)
    handles = {}
    for file in _safetensors_files(path):
        f = safe_open(file, framework="flax")
        handles.update({name: f for name in f.keys()})

    shapes = param_shapes(cfg)
    wanted = {name: (_TOP_NAMES[name], shape) for name, shape in shapes.items() if name != "layers"}
    for i, layer in enumerate(shapes["layers"]):
        for name, shape in layer.items():
            hf_name, transposed = _LAYER_NAMES[name]
            wanted[(i, name)] = ((f"model.layers.{i}.{hf_name}", transposed), shape)

    missing = [hf for (hf, _), _ in wanted.values() if hf not in handles]
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks {len(missing)} tensors the config needs: {', '.join(missing[:8])}")

    loaded, wrong = {}, []
    for key, ((hf_name, transposed), shape) in wanted.items():
        raw = handles[hf_name].get_tensor(hf_name)
        tensor = raw.T if transposed else raw
        if tuple(tensor.shape) != shape:
            wrong.append(f"{hf_name}: expected {shape[::-1] if transposed else shape}, got {tuple(raw.shape)}")
            continue
        loaded[key] = jnp.asarray(tensor, dtype=dtype)
    if wrong:
        raise ValueError(f"checkpoint {path!r} has mis-shaped tensors: {'; '.join(wrong[:8])}")

    params = {name: loaded[name] for name in shapes if name != "layers"}
    params["layers"] = tuple(
        {name: loaded[(i, name)] for name in layer} for i, layer in enumerate(shapes["layers"])
    )
    return params
