"""Load a local Hugging Face checkpoint (config.json + one or many *.safetensors) into a params pytree."""

from __future__ import annotations

import glob
import json
import os

import jax.numpy as jnp
from safetensors import safe_open

from jaxrunner.config import ModelConfig
from jaxrunner.models.llama import Params, fused_parts, param_shapes

# Our name -> (Hugging Face names, stored transposed?). HF linear weights are [out, in]; ours are
# [in, out]. A tensor with several HF names is their concatenation along its last axis (llama.fused_parts).
_LAYER_NAMES = {
    "attn_norm": (("input_layernorm.weight",), False),
    "wqkv": (("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), True),
    "wo": (("self_attn.o_proj.weight",), True),
    "bqkv": (("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), False),
    "q_norm": (("self_attn.q_norm.weight",), False),
    "k_norm": (("self_attn.k_norm.weight",), False),
    "mlp_norm": (("post_attention_layernorm.weight",), False),
    "w_gate_up": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), True),
    "w_down": (("mlp.down_proj.weight",), True),
}
_TOP_NAMES = {
    "embed": (("model.embed_tokens.weight",), False),
    "final_norm": (("model.norm.weight",), False),
    "lm_head": (("lm_head.weight",), True),
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

    shapes, fused = param_shapes(cfg), fused_parts(cfg)

    def parts(table: dict, name: str, shape: tuple, prefix: str = "") -> list[tuple[str, bool, tuple]]:
        """(HF name, transposed, expected shape) of each tensor whose concatenation is `name`."""
        hf_names, transposed = table[name]
        widths = fused.get(name, (shape[-1],))
        return [(prefix + hf, transposed, shape[:-1] + (w,)) for hf, w in zip(hf_names, widths, strict=True)]

    wanted = {name: parts(_TOP_NAMES, name, shape) for name, shape in shapes.items() if name != "layers"}
    for i, layer in enumerate(shapes["layers"]):
        for name, shape in layer.items():
            wanted[(i, name)] = parts(_LAYER_NAMES, name, shape, f"model.layers.{i}.")

    missing = [hf for parts in wanted.values() for hf, _, _ in parts if hf not in handles]
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks {len(missing)} tensors the config needs: {', '.join(missing[:8])}")

    loaded, wrong = {}, []
    for key, parts in wanted.items():
        tensors = []
        for hf_name, transposed, shape in parts:
            raw = handles[hf_name].get_tensor(hf_name)
            tensor = raw.T if transposed else raw
            if tuple(tensor.shape) != shape:
                wrong.append(f"{hf_name}: expected {shape[::-1] if transposed else shape}, got {tuple(raw.shape)}")
            tensors.append(jnp.asarray(tensor, dtype=dtype))
        loaded[key] = tensors[0] if len(tensors) == 1 else jnp.concatenate(tensors, axis=-1)
    if wrong:
        raise ValueError(f"checkpoint {path!r} has mis-shaped tensors: {'; '.join(wrong[:8])}")

    params = {name: loaded[name] for name in shapes if name != "layers"}
    params["layers"] = tuple(
        {name: loaded[(i, name)] for name in layer} for i, layer in enumerate(shapes["layers"])
    )
    return params
