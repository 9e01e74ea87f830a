"""Load a local checkpoint into a params pytree: a Hugging Face directory (config.json + one or many
*.safetensors), a GGUF file (`gguf_file`), or a directory of config.json + params saved with orbax
(`save_params`: how a converted GGUF is cached).

`open_checkpoint` reads the config and every tensor's name and shape (cheap, and where a corrupt or
truncated file shows); `Checkpoint.load` then reads the tensors. The engine opens the checkpoint
before anything slow, so a broken one fails at once with one line naming the file.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from safetensors import SafetensorError, safe_open

from jaxrunner.config import ModelConfig
from jaxrunner.checkpoints.gguf_file import GGUFFile, gguf_path, open_gguf
from jaxrunner.models.llama import Params, fused_parts, param_shapes, param_structs

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
# Mixture-of-Experts layers: "{e}" stands for each expert's index, the experts stacked on a first axis.
_MOE_LAYER_NAMES = {
    "Qwen3MoeForCausalLM": {
        "router": (("mlp.gate.weight",), True),
        "experts_gate_up": (("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"), True),
        "experts_down": (("mlp.experts.{e}.down_proj.weight",), True),
    },
    "MixtralForCausalLM": {
        "router": (("block_sparse_moe.gate.weight",), True),
        "experts_gate_up": (("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight"), True),
        "experts_down": (("block_sparse_moe.experts.{e}.w2.weight",), True),
    },
}
# Gemma's post_attention_layernorm follows attention; its MLP's own norm comes before it, and one after.
_GEMMA_LAYER_NAMES = _LAYER_NAMES | {
    "mlp_norm": (("pre_feedforward_layernorm.weight",), False),
    "post_attn_norm": (("post_attention_layernorm.weight",), False),
    "post_mlp_norm": (("post_feedforward_layernorm.weight",), False),
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
    expert: int | None = None  # the index on the stacked experts' first axis


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint whose config, tensor names and shapes were checked: loading it reads data only."""

    path: str
    config: ModelConfig
    tensors: SafetensorsFiles | GGUFFile  # by Hugging Face name: shape(name), read(name)
    # our name (or (layer, name)) -> its parts, concatenated along the last axis (expert by expert,
    # the experts then stacked)
    parts: dict[object, list[Part]]

    def load(self, dtype: str = "float32") -> Params:
        """Every param, cast to `dtype`."""
        loaded = {}
        for key, parts in self.parts.items():
            groups: dict[int | None, list[jax.Array]] = {}
            for part in parts:
                try:
                    raw = self.tensors.read(part.name)
                except (SafetensorError, ValueError) as e:
                    raise ValueError(f"cannot read tensor {part.name} of checkpoint {self.path!r}: {e}") from None
                groups.setdefault(part.expert, []).append(jnp.asarray(raw.T if part.transposed else raw, dtype=dtype))
            joined = [g[0] if len(g) == 1 else jnp.concatenate(g, axis=-1) for g in groups.values()]
            loaded[key] = joined[0] if None in groups else jnp.stack(joined)
        shapes = param_shapes(self.config)
        params = {name: loaded[name] for name in shapes if name != "layers"}
        params["layers"] = tuple({name: loaded[(i, name)] for name in layer} for i, layer in enumerate(shapes["layers"]))
        return params


PARAMS_DIR = "params"  # the orbax checkpoint inside a directory written by save_params


@dataclass(frozen=True)
class SavedParams:
    """A directory of config.json + params saved by `save_params`."""

    path: str
    config: ModelConfig

    def load(self, dtype: str = "float32") -> Params:
        """Every param restored straight onto the device in `dtype` (orbax casts as it reads)."""
        import orbax.checkpoint as ocp

        target = param_structs(self.config, dtype, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
        try:
            return ocp.StandardCheckpointer().restore(os.path.join(self.path, PARAMS_DIR), target)
        except Exception as e:  # orbax and TensorStore raise bare Exceptions for damaged files
            reason = " ".join(str(e).split())
            raise ValueError(f"cannot restore the params saved in {self.path!r} ({reason:.300}); "
                             "delete the directory to convert anew") from None


def save_params(path: str, params: Params) -> None:
    """Write `params` into the directory `path` (which holds config.json) for `SavedParams`."""
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(os.path.abspath(path), PARAMS_DIR), params)
    checkpointer.wait_until_finished()


def open_checkpoint(path: str | os.PathLike) -> Checkpoint | SavedParams:
    """The config and the open weights of a local checkpoint (a directory, or a GGUF file), every
    tensor the config needs present with the right shape (ValueError naming the file or tensor otherwise)."""
    path = os.fspath(path)
    if os.path.isdir(os.path.join(path, PARAMS_DIR)):
        return SavedParams(path, ModelConfig.from_hf(path))
    if (gguf := gguf_path(path)) is not None:
        tensors = open_gguf(gguf)
        config = ModelConfig.from_hf_config(tensors.hf_config())
    else:
        config = ModelConfig.from_hf(path)
        tensors = SafetensorsFiles(_safetensors_files(path))

    shapes, fused = param_shapes(config), fused_parts(config)
    layer_names = (_GEMMA_LAYER_NAMES if config.gemma else _LAYER_NAMES) | _MOE_LAYER_NAMES.get(config.architecture, {})

    def parts(table: dict, name: str, shape: tuple, prefix: str = "") -> list[Part]:
        hf_names, transposed = table[name]
        widths = fused.get(name, (shape[-1],))
        if "{e}" not in hf_names[0]:
            return [Part(prefix + hf, transposed, shape[:-1] + (w,)) for hf, w in zip(hf_names, widths, strict=True)]
        return [Part(prefix + hf.format(e=e), transposed, shape[1:-1] + (w,), e)
                for e in range(shape[0]) for hf, w in zip(hf_names, widths, strict=True)]

    wanted = {name: parts(_TOP_NAMES, name, shape) for name, shape in shapes.items() if name != "layers"}
    for i, layer in enumerate(shapes["layers"]):
        for name, shape in layer.items():
            wanted[(i, name)] = parts(layer_names, name, shape, f"model.layers.{i}.")
    missing = [p.name for ps in wanted.values() for p in ps if p.name not in tensors.tensors]
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks {len(missing)} tensors the config needs: {', '.join(missing[:8])}")
    wrong = []
    for p in (p for ps in wanted.values() for p in ps):
        stored = tensors.shape(p.name)
        if (stored[::-1] if p.transposed else stored) != p.shape:
            wrong.append(f"{p.name}: expected {p.shape[::-1] if p.transposed else p.shape}, got {stored}")
    if wrong:
        raise ValueError(f"checkpoint {path!r} has mis-shaped tensors: {'; '.join(wrong[:8])}")
    return Checkpoint(path, config, tensors, wanted)


class SafetensorsFiles:
    """The tensors of a set of safetensors files, by name."""

    def __init__(self, files: list[str]) -> None:
        self.tensors = {}  # name -> the open file holding it
        for file in files:
            try:
                f = safe_open(file, framework="flax")
            except (OSError, SafetensorError) as e:
                raise ValueError(f"cannot read the weights file {file!r}: {e}") from None
            self.tensors.update({name: f for name in f.keys()})

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].get_slice(name).get_shape())

    def read(self, name: str):
        return self.tensors[name].get_tensor(name)


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
        raise ValueError(f"no *.safetensors or *.gguf files in {path!r}: jaxrunner reads safetensors and GGUF checkpoints")
    return files


def load_model(path: str | os.PathLike, dtype: str = "float32") -> tuple[ModelConfig, Params]:
    """Read the config and every weight of a local checkpoint, cast to `dtype`."""
    checkpoint = open_checkpoint(path)
    return checkpoint.config, checkpoint.load(dtype)
