"""Load a local Hugging Face checkpoint (config.json + one or many *.safetensors) into a params pytree.

`open_checkpoint` reads the config and every weight file's header (cheap, and where a corrupt or
truncated file shows); `Checkpoint.load` then reads the tensors. The engine opens the checkpoint
before anything slow, so a broken one fails at once with one line naming the file.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass

import jax.numpy as jnp
from safetensors import SafetensorError, safe_open

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


@dataclass(frozen=True)
class Part:
    """One checkpoint tensor that makes up (part of) one of our params."""

    name: str  # Hugging Face name
    transposed: bool
    shape: tuple[int, ...]  # ours, after the transpose


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint whose config, tensor names and shapes were checked: loading it reads data only."""

    path: str
    config: ModelConfig
    files: dict[str, object]  # Hugging Face tensor name -> the open safetensors file holding it
    parts: dict[object, list[Part]]  # our name (or (layer, name)) -> its parts, concatenated along the last axis

    def load(self, dtype: str = "float32") -> Params:
        """Every param, cast to `dtype`."""
        loaded = {}
        for key, parts in self.parts.items():
            tensors = []
            for part in parts:
                try:
                    raw = self.files[part.name].get_tensor(part.name)
                except SafetensorError as e:
                    raise ValueError(f"cannot read tensor {part.name} of checkpoint {self.path!r}: {e}") from None
                tensors.append(jnp.asarray(raw.T if part.transposed else raw, dtype=dtype))
            loaded[key] = tensors[0] if len(tensors) == 1 else jnp.concatenate(tensors, axis=-1)
        shapes = param_shapes(self.config)
        params = {name: loaded[name] for name in shapes if name != "layers"}
        params["layers"] = tuple({name: loaded[(i, name)] for name in layer} for i, layer in enumerate(shapes["layers"]))
        return params


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """The config and the open weight files of a local checkpoint directory, every tensor the
    config needs present with the right shape (ValueError naming the file or tensor otherwise)."""
    path = os.fspath(path)
    config = ModelConfig.from_hf(path)
    files = {}
    for file in _safetensors_files(path):
        try:
            f = safe_open(file, framework="flax")
        except (OSError, SafetensorError) as e:
            raise ValueError(f"cannot read the weights file {file!r}: {e}") from None
        files.update({name: f for name in f.keys()})

    shapes, fused = param_shapes(config), fused_parts(config)

    def parts(table: dict, name: str, shape: tuple, prefix: str = "") -> list[Part]:
        hf_names, transposed = table[name]
        widths = fused.get(name, (shape[-1],))
        return [Part(prefix + hf, transposed, shape[:-1] + (w,)) for hf, w in zip(hf_names, widths, strict=True)]

    wanted = {name: parts(_TOP_NAMES, name, shape) for name, shape in shapes.items() if name != "layers"}
    for i, layer in enumerate(shapes["layers"]):
        for name, shape in layer.items():
            wanted[(i, name)] = parts(_LAYER_NAMES, name, shape, f"model.layers.{i}.")
    missing = [p.name for ps in wanted.values() for p in ps if p.name not in files]
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks {len(missing)} tensors the config needs: {', '.join(missing[:8])}")
    wrong = []
    for p in (p for ps in wanted.values() for p in ps):
        stored = tuple(files[p.name].get_slice(p.name).get_shape())
        if (stored[::-1] if p.transposed else stored) != p.shape:
            wrong.append(f"{p.name}: expected {p.shape[::-1] if p.transposed else p.shape}, got {stored}")
    if wrong:
        raise ValueError(f"checkpoint {path!r} has mis-shaped tensors: {'; '.join(wrong[:8])}")
    return Checkpoint(path, config, files, wanted)


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"cannot read {index!r}: expected JSON with a weight_map ({type(e).__name__}: {e})") from None
        return [os.path.join(path, n) for n in names]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {path!r}: only safetensors checkpoints are supported")
    return files


def load_model(path: str | os.PathLike, dtype: str = "float32") -> tuple[ModelConfig, Params]:
    """Read the config and every weight of a local checkpoint directory, cast to `dtype`."""
    checkpoint = open_checkpoint(path)
    return checkpoint.config, checkpoint.load(dtype)
