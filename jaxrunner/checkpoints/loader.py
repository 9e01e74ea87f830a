"""Load a local checkpoint into a params pytree: a Hugging Face directory (config.json + one or many
*.safetensors), a GGUF file (`gguf_file`), or a directory of config.json + params saved with orbax
(`save_params`: how a converted GGUF is cached).

`open_checkpoint` reads the config and every tensor's name and shape (cheap, and where a corrupt or
truncated file shows); `Checkpoint.load` then reads the tensors. The engine opens the checkpoint
before anything slow, so a broken one fails at once with one line naming the file. Which checkpoint
tensors make each param, and how, is declared once in `models.tensors`.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from jaxrunner.config import ModelConfig
from jaxrunner.checkpoints.fp8 import block_size, read_fp8
from jaxrunner.checkpoints.gguf_blocks import KEEPS_BLOCKS
from jaxrunner.checkpoints.gguf_file import GGUFFile, gguf_path, open_gguf
from jaxrunner.models.llama import Params, param_structs, quantize_params
from jaxrunner.models.quantization import Quantized, join_columns, widened
from jaxrunner.models.tensors import DENSE, Tensor, each_tensor, layer_tensors, top_tensors


logger = logging.getLogger(__name__)


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
    fp8_block: tuple[int, int] | None = None  # an fp8 checkpoint's scale blocks (`fp8.block_size`)

    def load(self, dtype: str = "float32", held: ModelConfig | None = None) -> Params:
        """Every param, stored in `dtype` as its tensor's storage holds it: as the checkpoint holds
        it, or as `held` (`held_config`) does, each weight quantized as it is read, so the dense
        model is never on the device whole."""
        cfg = held or self.config
        top, layer = top_tensors(cfg), layer_tensors(cfg)
        params = {name: self._read(name, t, dtype) for name, t in top.items()}
        params["layers"] = tuple({name: self._read((i, name), t, dtype) for name, t in layer.items()}
                                 for i in range(self.config.num_layers))
        return params

    def _read(self, key: str | tuple[int, str], tensor: Tensor, dtype: str) -> jax.Array:
        """One param: its parts read, stored and joined."""
        groups: dict[int | None, list[jax.Array]] = {}
        stored_fp8 = self.config.quantization == "fp8" and tensor.storage != DENSE  # its values and scales as they are
        for part in self.parts[key]:
            try:
                if stored_fp8:
                    value = read_fp8(self.tensors, part.name, self.fp8_block)
                elif (blocks := self._blocks(part, tensor)) is not None:
                    value = widened(blocks, tensor.storage)
                else:
                    raw = self.tensors.read(part.name)
                    value = tensor.storage.store(raw.T if part.transposed else raw, dtype)
            except (SafetensorError, ValueError, KeyError) as e:
                raise ValueError(f"cannot read tensor {part.name} of checkpoint {self.path!r}: {e}") from None
            groups.setdefault(part.expert, []).append(value)
        joined = [g[0] if len(g) == 1 else join_columns(g) for g in groups.values()]
        return joined[0] if None in groups else jax.tree.map(lambda *xs: jnp.stack(xs), *joined)

    def _blocks(self, part: Part, tensor: Tensor) -> Quantized | None:
        """A GGUF file's quantized linear weight as its blocks hold it, for a model held in int8 or
        int4 (`checkpoints.gguf_blocks`); None for anything else."""
        if (self.config.quantization not in KEEPS_BLOCKS or tensor.storage == DENSE or not part.transposed
                or not isinstance(self.tensors, GGUFFile)):
            return None
        blocks = self.tensors.read_blocks(part.name)
        if blocks is None and self.tensors.kept(part.name):
            logger.warning("the blocks of %s do not give back their floats exactly: quantizing its floats instead",
                           part.name)
        return blocks


PARAMS_DIR = "params"  # the orbax checkpoint inside a directory written by save_params
# Params this process saved and then handed over (`hand_over`), by directory: the start that just
# converted a model takes them from memory instead of reading back the files it wrote.
_handed_over: dict[str, Params] = {}


@dataclass(frozen=True)
class SavedParams:
    """A directory of config.json + params saved by `save_params`."""

    path: str
    config: ModelConfig

    def load(self, dtype: str = "float32", held: ModelConfig | None = None) -> Params:
        """Every param restored straight onto the device in `dtype` (orbax casts as it reads), then
        held as `held` (`held_config`) says."""
        params = self._restore(dtype)
        return params if held is None or held == self.config else quantize_params(held, params)

    def _restore(self, dtype: str) -> Params:
        """Committed to the first device, whether handed over or read: a program lowered for
        uncommitted params differs from one for committed params, so the start after a conversion
        would find none of the conversion's programs in the program cache."""
        import orbax.checkpoint as ocp

        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        params = _handed_over.pop(os.path.realpath(self.path), None)
        if params is not None and params["embed"].dtype == jnp.dtype(dtype):
            return jax.device_put(params, device)
        target = param_structs(self.config, dtype, device)
        try:
            stored = ocp.StandardCheckpointer().restore(os.path.join(self.path, PARAMS_DIR), jax.tree.map(_on_disk, target))
        except Exception as e:  # orbax and TensorStore raise bare Exceptions for damaged files
            reason = " ".join(str(e).split())
            raise ValueError(f"cannot restore the params saved in {self.path!r} ({reason:.300}); "
                             "delete the directory to convert anew") from None
        return jax.device_put(jax.tree.map(_in_memory, stored, target), device)


def save_params(path: str, params: Params) -> None:
    """Write `params` into the directory `path` (which holds config.json) for `SavedParams`."""
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(os.path.abspath(path), PARAMS_DIR), jax.tree.map(_on_disk, params))
    checkpointer.wait_until_finished()


def _on_disk(x):
    """An array (or its struct) as the files hold it: TensorStore has no 4-bit type, so int4 values
    are stored a byte each; orbax saves no empty array, so a symmetric format's offsets (zero-width)
    are stored as one zero (`_in_memory` takes both back)."""
    shape, dtype = (x.shape if x.size else (1,)), (jnp.uint8 if x.dtype == jnp.uint4 else x.dtype)
    if (shape, dtype) == (x.shape, x.dtype):
        return x
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=x.sharding)
    return x.astype(dtype) if x.size else jnp.zeros(shape, dtype)


def _in_memory(stored: jax.Array, want: jax.ShapeDtypeStruct) -> jax.Array:
    """A restored array as `want`, the param `_on_disk` stored."""
    if not want.size:
        return jnp.zeros(want.shape, want.dtype)
    return stored if stored.dtype == want.dtype else stored.astype(want.dtype)


def hand_over(path: str, params: Params) -> None:
    """`params`, which `save_params` wrote into what is now the directory `path`, for the next
    `SavedParams.load` of it in their dtype (once)."""
    _handed_over[os.path.realpath(path)] = params


def open_checkpoint(path: str | os.PathLike) -> Checkpoint | SavedParams:
    """The config and the open weights of a local checkpoint (a directory, or a GGUF file), every
    tensor the config needs present with the right shape (ValueError naming the file or tensor otherwise)."""
    path = os.fspath(path)
    if os.path.isdir(os.path.join(path, PARAMS_DIR)):
        return SavedParams(path, ModelConfig.from_hf(path))
    if (gguf := gguf_path(path)) is not None:
        tensors = open_gguf(gguf)
        config = tensors.config
    else:
        config = ModelConfig.from_hf(path)
        tensors = SafetensorsFiles(_safetensors_files(path))
    fp8 = block_size(path) if config.quantization == "fp8" else None

    def parts(tensor: Tensor, layer: int | None) -> list[Part]:
        weight, shape = tensor.weight, tensor.shape
        sources = list(zip(weight.sources, tensor.widths, strict=True))
        if "{e}" not in weight.sources[0].hf:
            return [Part(s.hf.format(i=layer), weight.transposed, shape[:-1] + (w,)) for s, w in sources]
        return [Part(s.hf.format(i=layer, e=e), weight.transposed, shape[1:-1] + (w,), e)
                for e in range(shape[0]) for s, w in sources]

    wanted = {t.name if i is None else (i, t.name): parts(t, i) for i, t in each_tensor(config)}
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
    return Checkpoint(path, config, tensors, wanted, fp8)


class SafetensorsFiles:
    """The tensors of a set of safetensors files, by name."""

    def __init__(self, files: list[str]) -> None:
        self.tensors = {}  # name -> the open file holding it
        self.files = {}  # name -> that file's path
        for file in files:
            try:
                f = safe_open(file, framework="flax")
            except (OSError, SafetensorError) as e:
                raise ValueError(f"cannot read the weights file {file!r}: {e}") from None
            self.tensors.update({name: f for name in f.keys()})
            self.files.update({name: file for name in f.keys()})

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].get_slice(name).get_shape())

    def read(self, name: str):
        if self.tensors[name].get_slice(name).get_dtype() == "F8_E4M3":  # which safetensors' readers cannot make
            return self._read_bytes(name, ml_dtypes.float8_e4m3fn)
        return self.tensors[name].get_tensor(name)

    def _read_bytes(self, name: str, dtype) -> np.ndarray:
        """A tensor read straight from its file: an 8-byte header length, the JSON header, the data."""
        with open(self.files[name], "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            entry = json.loads(f.read(header_len))[name]
            start, end = entry["data_offsets"]
            f.seek(8 + header_len + start)
            return np.frombuffer(f.read(end - start), dtype).reshape(entry["shape"])


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


def held_config(config: ModelConfig, quantization: str | None) -> ModelConfig:
    """`config` with its weights held in `quantization`'s format (`models.quantization`; None: as
    the checkpoint holds them)."""
    if quantization is None or quantization == config.quantization:
        return config
    if config.quantization is not None:
        raise ValueError(f"the checkpoint holds {config.quantization} weights; quantization={quantization!r} would "
                         f"round them again: leave quantization unset (or {config.quantization!r})")
    return dataclasses.replace(config, quantization=quantization)


def held_as(config: ModelConfig, params: Params, quantization: str | None) -> tuple[ModelConfig, Params]:
    """A loaded model held in `quantization`'s format (`held_config`)."""
    held = held_config(config, quantization)
    return (config, params) if held == config else (held, quantize_params(held, params))
