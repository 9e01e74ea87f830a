"""GGUF checkpoints, llama.cpp's one-file format: the model's config, its tensors under Hugging Face
names (each tensor's llama.cpp name is declared beside its Hugging Face one in `models.tensors`), and
the tokenizer's metadata (the header read by `gguf_header`, the blocks dequantized by the `gguf`
package).

Quantized tensors are dequantized to float32 on the host (`gguf.quants.dequantize`), so the runner
sees an ordinary float checkpoint. llama.cpp's converter stores the Llama family's q and k
projections with the two halves of each head's rotary pairs interleaved, for its own RoPE layout;
`read` undoes that, since our RoPE rotates halves as Hugging Face does (Qwen and Gemma files are
stored as is), and takes back the one it adds to Gemma's norm weights.

Mixture-of-Experts files (qwen3moe; Mixtral is a llama file with `expert_count`) stack each layer's
experts in one tensor per projection; each expert is read, under its Hugging Face name, as its own
slice of the stack.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import numpy as np

from jaxrunner.checkpoints.gguf_blocks import KEPT, unpack
from jaxrunner.checkpoints.gguf_header import StoredTensor, read_header
from jaxrunner.config import ModelConfig, WeightFormat, default_weight_format
from jaxrunner.models.quantization import Quantized
from jaxrunner.models.tensors import LM_HEAD, QUANTIZED, each_tensor, layer_tensors

# GGUF's general.architecture -> Hugging Face architecture (and model_type for its config class).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3moe": "Qwen3MoeForCausalLM", "gemma3": "Gemma3ForCausalLM"}
MIXTRAL = "MixtralForCausalLM"  # a llama file with experts
_PERMUTED_QK = ("llama",)
# llama.cpp's converter stores Gemma's norm weights plus one (its norms scale by the weight itself).
_NORMS_PLUS_ONE = ("gemma3",)
GEMMA3_LOCAL_ROPE_THETA = 10000.0  # not in the file: llama.cpp and transformers both take Gemma 3's own

# Tensors that change the model's maths in a way jaxrunner does not implement.
_UNSUPPORTED_TENSORS = {"rope_freqs.weight": "rotary frequency factors (Llama 3.1 rope scaling)"}


def gguf_path(path: str | os.PathLike) -> str | None:
    """The GGUF file that `path` names: the file itself, or the only *.gguf in a directory that holds
    no safetensors; None when `path` is not a GGUF checkpoint."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return path if path.endswith(".gguf") else None
    if not os.path.isdir(path) or any(f.endswith(".safetensors") for f in os.listdir(path)):
        return None
    found = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if len(found) > 1:
        raise ValueError(f"{path!r} holds several GGUF files ({', '.join(found)}); pass the one to load")
    return os.path.join(path, found[0]) if found else None


@dataclass(frozen=True)
class GGUFFile:
    """An open GGUF file whose architecture, tensor names and quantization types were checked."""

    path: str
    architecture: str  # GGUF's name: llama, qwen2, qwen3, qwen3moe, gemma3
    metadata: dict  # key -> value, arrays as lists
    stored: dict[str, StoredTensor]  # by llama.cpp's name

    def hf_config(self):
        """The model's config as the `transformers` config class of its family."""
        import transformers

        arch, meta = self.architecture, self.metadata

        def key(name: str, default=None):
            value = meta.get(f"{arch}.{name}", default)
            if value is None:
                raise ValueError(f"GGUF file {self.path!r} lacks the metadata key {arch}.{name}")
            return value

        num_heads = int(key("attention.head_count"))
        hidden = int(key("embedding_length"))
        config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                        "qwen3": transformers.Qwen3Config, "qwen3moe": transformers.Qwen3MoeConfig,
                        "gemma3": transformers.Gemma3TextConfig}[arch]
        rope = {"rope_type": "default", "rope_theta": _as_written(key("rope.freq_base", 10000.0))}
        extra = {}
        if arch == "gemma3":  # the rest (layer pattern, query scale, GeGLU) as Gemma3TextConfig defaults them
            rope = {"full_attention": rope, "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_THETA}}
            extra = dict(sliding_window=int(key("attention.sliding_window")),
                         query_pre_attn_scalar=int(key("attention.key_length", hidden // num_heads)))
        if arch == "qwen3moe":  # llama.cpp renormalises the chosen experts' weights for this family
            extra = dict(num_experts=int(key("expert_count")), num_experts_per_tok=int(key("expert_used_count")),
                         moe_intermediate_size=int(key("expert_feed_forward_length")), norm_topk_prob=True,
                         decoder_sparse_step=1, mlp_only_layers=[])
        if self.hf_architecture == MIXTRAL:
            config_class = transformers.MixtralConfig
            extra = dict(num_local_experts=int(key("expert_count")), num_experts_per_tok=int(key("expert_used_count")))
        return config_class(
            architectures=[self.hf_architecture],
            vocab_size=int(meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_hidden_layers=int(key("block_count")),
            num_attention_heads=num_heads,
            num_key_value_heads=int(key("attention.head_count_kv", num_heads)),
            head_dim=int(key("attention.key_length", hidden // num_heads)),
            max_position_embeddings=int(key("context_length")),
            rms_norm_eps=_as_written(key("attention.layer_norm_rms_epsilon")),
            rope_parameters=rope,
            tie_word_embeddings=LM_HEAD.sources[0].gguf not in self.stored,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
            **extra,
        )

    @functools.cached_property
    def config(self) -> ModelConfig:
        """The model's config as jaxrunner reads it (`ModelConfig`)."""
        return ModelConfig.from_hf_config(self.hf_config())

    @functools.cached_property
    def tensors(self) -> dict:
        """The model's tensors that the file holds: Hugging Face name -> (its `StoredTensor`, the
        expert's index in its stack or None)."""
        tensors = {}
        for i, t in each_tensor(self.config):
            for source in t.weight.sources:
                tensor = self.stored.get(source.gguf.format(i=i))
                if tensor is None:  # the loader names the missing ones
                    continue
                if "{e}" in source.hf:  # one entry per expert of the stack, its first axis in Hugging Face's order
                    tensors.update({source.hf.format(i=i, e=e): (tensor, e) for e in range(int(tensor.shape[-1]))})
                else:
                    tensors[source.hf.format(i=i)] = (tensor, None)
        return tensors

    @property
    def hf_architecture(self) -> str:
        return _hf_architecture(self.architecture, self.metadata)

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape in Hugging Face's order ([out, in] for a linear weight)."""
        tensor, expert = self.tensors[name]
        shape = tuple(int(n) for n in reversed(tensor.shape))
        return shape if expert is None else shape[1:]

    def read(self, name: str) -> np.ndarray:
        """The tensor as float32, in Hugging Face's layout."""
        from gguf.quants import dequantize

        tensor, expert = self.tensors[name]
        data = tensor.data if expert is None else tensor.data[expert]
        values = self._rows(name, dequantize(data, tensor.tensor_type).reshape(self.shape(name)))
        if self.architecture in _NORMS_PLUS_ONE and name.endswith("norm.weight"):
            values = values - 1.0
        return values

    def read_blocks(self, name: str) -> Quantized | None:
        """A linear weight as its blocks hold it (`gguf_blocks`): its integers as int8 values
        [out, in], each group's scale [in / group, out] and, for a type with them, offset; None for
        a tensor of a type not kept, or whose blocks `unpack` cannot give back exactly."""
        tensor, expert = self.tensors[name]
        if tensor.tensor_type not in KEPT:
            return None
        data = tensor.data if expert is None else tensor.data[expert]
        blocks = unpack(data.reshape(self.shape(name)[0], -1), tensor.tensor_type)
        if blocks is None:
            return None
        values, scales, offsets = blocks
        return Quantized(self._rows(name, values), self._rows(name, scales).T,
                         np.zeros((0,), np.float32) if offsets is None else self._rows(name, offsets).T)

    def kept(self, name: str) -> bool:
        """Whether the tensor's blocks are of a type kept as they are (`gguf_blocks.KEPT`)."""
        return self.tensors[name][0].tensor_type in KEPT

    def kept_formats(self, fmt: str) -> tuple[WeightFormat, ...]:
        """How the layers' quantized weights are held in a model of format `fmt` (int8 or int4)
        that keeps this file's blocks as they are: each weight in the one form that holds every
        layer's and every part's blocks exactly (int4 if all are 4-bit blocks and `fmt` is int4,
        else int8; groups that divide all of theirs; offsets if any has them, or for int4). A
        tensor of a type not kept counts as `fmt` holds a float weight."""
        formats = []
        for name, t in layer_tensors(self.config).items():
            if t.weight in QUANTIZED:
                types = {self.stored[s.gguf.format(i=i)].tensor_type
                         for i in range(self.config.num_layers) for s in t.weight.sources}
                held = [_held(qtype, fmt, t.shape[-2]) for qtype in types]
                wide = "int8" if any(h.format == "int8" for h in held) else "int4"
                formats.append(WeightFormat(name, wide, math.gcd(*(h.group for h in held)),
                                            wide == "int4" or any(h.offsets for h in held)))
        return tuple(formats)

    def _rows(self, name: str, rows: np.ndarray) -> np.ndarray:
        """A tensor's rows in Hugging Face's order (llama.cpp reorders the q and k projections')."""
        if self.architecture in _PERMUTED_QK and name.endswith((".q_proj.weight", ".k_proj.weight")):
            heads = self.metadata[f"{self.architecture}.attention.head_count" + ("_kv" if ".k_proj" in name else "")]
            return _unpermute_rotary(rows, int(heads))
        return rows


def _held(qtype, fmt: str, k: int) -> WeightFormat:
    """How a weight (unnamed) of K rows in blocks of `qtype` is held on its own in a model of format `fmt`:
    as its blocks hold it (4-bit ones in int4 if `fmt` is, the others in int8), or for a type not
    kept, as `fmt` holds a float weight."""
    if qtype not in KEPT:
        return default_weight_format("", fmt, k)
    kept = KEPT[qtype]
    if fmt == "int4" and kept.bits <= 4:
        return WeightFormat("", "int4", kept.group, True)
    return WeightFormat("", "int8", kept.group, kept.offsets)


def open_gguf(path: str) -> GGUFFile:
    """Read a GGUF file's metadata and tensor directory (the weights stay on disk until `read`)."""
    try:
        metadata, tensors = read_header(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the GGUF file {path!r}: {e}") from None
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"GGUF file {path!r} holds a {arch!r} model; jaxrunner reads GGUF files of {', '.join(ARCHITECTURES)}"
        )
    for tensor in tensors:
        if tensor.name in _UNSUPPORTED_TENSORS:
            raise ValueError(f"GGUF file {path!r} uses {_UNSUPPORTED_TENSORS[tensor.name]}, which jaxrunner does not support")
    file = GGUFFile(path, arch, metadata, {tensor.name: tensor for tensor in tensors})
    _check_types(path, [tensor for tensor, _ in file.tensors.values()])
    return file


def _as_written(value: float) -> float:
    """A float32 metadata value as the converter's float64 source had it (1e-05, not 9.99999974e-06):
    the shortest decimal that rounds to the same float32."""
    return float(str(np.float32(value)))


def _hf_architecture(arch: str, metadata: dict) -> str:
    return MIXTRAL if arch == "llama" and metadata.get("llama.expert_count") else ARCHITECTURES[arch]


def _check_types(path: str, tensors) -> None:
    """Every quantization type in the file dequantizes: tried on one row of one tensor of each type."""
    from gguf.quants import dequantize

    first_of_type = {t.tensor_type: t for t in tensors}
    unsupported = []
    for qtype, tensor in first_of_type.items():
        try:
            dequantize(tensor.data[:1], qtype)
        except (NotImplementedError, ValueError):
            unsupported.append(qtype.name)
    if unsupported:
        raise ValueError(f"GGUF file {path!r} uses quantization types jaxrunner cannot dequantize: {', '.join(unsupported)}")


def _unpermute_rotary(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: within each head, rows (2i, 2i + 1) back to (i, i + d/2)."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
