"""The tensor inventory: every weight of the model declared once, and which of them a model has.

A `Weight` is a kind of weight, declared once below: its key in the params pytree, the axis tensor
parallelism splits, how random init fills it, the checkpoint tensors it is read from (under Hugging
Face's names and llama.cpp's, concatenated along our last axis, transposed or not) and how it is
stored. `layer_tensors` and `top_tensors` are the one place that decides, from a ModelConfig, which
weights a model has, their shapes and how each is held (`Tensor`: dense, or as the model's
`quantization` format holds it: `ModelConfig.weight_format`). Everything else is derived from them: the params'
shapes, PartitionSpecs, ShapeDtypeStructs and random init (`llama.param_shapes` and its siblings),
the checkpoint readers' names (`checkpoints.loader`, `checkpoints.gguf_file`) and the projections
LoRA adapts (`lora.slots.projection_parts`, `lora.adapters.MODULES`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxrunner.config import ModelConfig
from jaxrunner.models.quantization import QuantizedStorage


@dataclass(frozen=True)
class Dense:
    """How a weight is held on the device: one array of its shape in the runner's dtype. The params'
    structs and specs, random init and the checkpoint loaders ask a tensor's storage for its arrays;
    a quantized format is another storage with these methods (`quantization.QuantizedStorage`)."""

    def struct(self, shape: tuple[int, ...], dtype: str,
               sharding: jax.sharding.Sharding | None = None) -> jax.ShapeDtypeStruct:
        """The stored array without data, for ahead-of-time compiles and for restoring saved params."""
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def store(self, values: jax.Array | np.ndarray, dtype: str) -> jax.Array:
        """The stored array of float `values` (a random draw, or a tensor read from a checkpoint)."""
        return jnp.asarray(values, dtype)

    def spec(self, spec: jax.sharding.PartitionSpec, shape: tuple[int, ...]) -> jax.sharding.PartitionSpec:
        return spec


DENSE = Dense()
MODEL_AXIS = "model"  # the mesh axis tensor parallelism splits over
# The axis tensor parallelism splits (Megatron's): q|k|v and gate|up by their columns, o and down by
# their rows (their matmuls end in an all-reduce), the embedding and the LM head by the vocabulary;
# a Mixture-of-Experts layer's stacked experts by expert (expert parallelism: `moe.moe_mlp`).
COLUMNS, ROWS, EXPERTS = -1, 0, 0


@dataclass(frozen=True)
class Source:
    """A checkpoint tensor that makes (part of) a weight, under Hugging Face's name and llama.cpp's.
    "{i}" stands for the layer's index, "{e}" for each expert's: Hugging Face stores a layer's experts
    one by one, which llama.cpp stacks in one tensor (read expert by expert as its own slice)."""

    hf: str
    gguf: str


@dataclass(frozen=True)
class Weight:
    """A kind of weight, declared once."""

    name: str  # its key in the params pytree (in a layer's dict for a layer's weight)
    sources: tuple[Source, ...]  # concatenated along our last axis (q|k|v, gate|up)
    split: int | None = None  # the axis split over the tensor-parallel shards; None: each holds it whole
    transposed: bool = False  # checkpoints store it [out, in] (a linear layer's weight); we store [in, out]
    init: str = "normal"  # random init: "normal" (std * N(0, 1)) or "ones" (a norm's weight)


@dataclass(frozen=True)
class Tensor:
    """A weight of one model: its kind and, from the ModelConfig, its shape."""

    weight: Weight
    shape: tuple[int, ...]
    fused: tuple[int, ...] = ()  # the widths of its sources along the last axis, when it has several
    storage: Dense | QuantizedStorage = DENSE

    @property
    def name(self) -> str:
        return self.weight.name

    @property
    def widths(self) -> tuple[int, ...]:
        """The width of each source along the last axis."""
        return self.fused or (self.shape[-1],)


def _layer(hf: str, gguf: str) -> Source:
    """A layer's tensor: Hugging Face's and llama.cpp's names under the layer."""
    return Source(f"model.layers.{{i}}.{hf}", f"blk.{{i}}.{gguf}")


def _norm(name: str, hf: str, gguf: str) -> Weight:
    return Weight(name, (_layer(f"{hf}.weight", f"{gguf}.weight"),), init="ones")


def _linear(name: str, split: int | None, *modules: tuple[str, str]) -> Weight:
    """A layer's linear weight, from the (Hugging Face, llama.cpp) modules side by side."""
    return Weight(name, tuple(_layer(f"{hf}.weight", f"{gguf}.weight") for hf, gguf in modules), split, transposed=True)


EMBED = Weight("embed", (Source("model.embed_tokens.weight", "token_embd.weight"),), ROWS)
FINAL_NORM = Weight("final_norm", (Source("model.norm.weight", "output_norm.weight"),), init="ones")
LM_HEAD = Weight("lm_head", (Source("lm_head.weight", "output.weight"),), COLUMNS, transposed=True)

_QKV = (("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"))
ATTN_NORM = _norm("attn_norm", "input_layernorm", "attn_norm")
WQKV = _linear("wqkv", COLUMNS, *_QKV)
BQKV = Weight("bqkv", tuple(_layer(f"{hf}.bias", f"{gguf}.bias") for hf, gguf in _QKV), COLUMNS)
Q_NORM = _norm("q_norm", "self_attn.q_norm", "attn_q_norm")
K_NORM = _norm("k_norm", "self_attn.k_norm", "attn_k_norm")
WO = _linear("wo", ROWS, ("self_attn.o_proj", "attn_output"))
MLP_NORM = _norm("mlp_norm", "post_attention_layernorm", "ffn_norm")
W_GATE_UP = _linear("w_gate_up", COLUMNS, ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"))
W_DOWN = _linear("w_down", ROWS, ("mlp.down_proj", "ffn_down"))
# Gemma's post_attention_layernorm follows attention; its MLP's own norm comes before the MLP, and one after.
GEMMA_MLP_NORM = _norm("mlp_norm", "pre_feedforward_layernorm", "ffn_norm")
POST_ATTN_NORM = _norm("post_attn_norm", "post_attention_layernorm", "post_attention_norm")
POST_MLP_NORM = _norm("post_mlp_norm", "post_feedforward_layernorm", "post_ffw_norm")


def _experts(block: str, gate: str, up: str, down: str) -> tuple[Weight, Weight, Weight]:
    """A Mixture-of-Experts MLP's router (whole on every shard) and experts (split by expert), under
    each family's module names."""
    each = f"{block}.experts.{{e}}"
    return (_linear("router", None, (f"{block}.gate", "ffn_gate_inp")),
            _linear("experts_gate_up", EXPERTS, (f"{each}.{gate}", "ffn_gate_exps"), (f"{each}.{up}", "ffn_up_exps")),
            _linear("experts_down", EXPERTS, (f"{each}.{down}", "ffn_down_exps")))


EXPERTS = {
    "Qwen3MoeForCausalLM": _experts("mlp", "gate_proj", "up_proj", "down_proj"),
    "MixtralForCausalLM": _experts("block_sparse_moe", "w1", "w3", "w2"),
}
# The projections a LoRA adapter may adapt; PEFT names each of their parts by its Hugging Face module.
LORA_TARGETS = (WQKV, WO, W_GATE_UP, W_DOWN)
QUANTIZED = LORA_TARGETS  # the weights `ModelConfig.quantization` holds in its format


def layer_tensors(cfg: ModelConfig) -> dict[str, Tensor]:
    """Every layer's tensors, by name, in the order random init draws them (`llama.init_params`)."""
    h, d, width = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    layer = [Tensor(ATTN_NORM, (h,)), Tensor(WQKV, (h, q + 2 * kv), (q, kv, kv)), Tensor(WO, (q, h)),
             Tensor(GEMMA_MLP_NORM if cfg.gemma else MLP_NORM, (h,))]
    if cfg.num_experts:
        e = cfg.num_experts
        router, gate_up, down = EXPERTS[cfg.architecture]
        layer += [Tensor(router, (h, e)), Tensor(gate_up, (e, h, 2 * width), (width, width)), Tensor(down, (e, width, h))]
    else:
        layer += [Tensor(W_GATE_UP, (h, 2 * width), (width, width)), Tensor(W_DOWN, (width, h))]
    if cfg.qkv_bias:
        layer.append(Tensor(BQKV, (q + 2 * kv,), (q, kv, kv)))
    if cfg.qk_norm:
        layer += [Tensor(Q_NORM, (d,)), Tensor(K_NORM, (d,))]
    if cfg.gemma:
        layer += [Tensor(POST_ATTN_NORM, (h,)), Tensor(POST_MLP_NORM, (h,))]
    if cfg.quantization:
        layer = [dataclasses.replace(t, storage=_quantized(cfg, t)) if t.weight in QUANTIZED else t for t in layer]
        unknown = {held.weight for held in cfg.weight_formats} - {t.name for t in layer if t.weight in QUANTIZED}
        if unknown:
            raise ValueError(f"weight_formats name {', '.join(sorted(unknown))}, which this model does not quantize")
    return {t.name: t for t in layer}


def _quantized(cfg: ModelConfig, tensor: Tensor) -> QuantizedStorage:
    k = tensor.shape[-2]
    held = cfg.weight_format(tensor.name, k)
    if k % held.group:
        raise ValueError(f"{tensor.name} has {k} rows, which groups of {held.group} do not divide")
    return QuantizedStorage(held.format, held.group, held.offsets)


def top_tensors(cfg: ModelConfig) -> dict[str, Tensor]:
    """The tensors outside the layers, by name, in the order random init draws them."""
    h, vocab = cfg.hidden_size, cfg.padded_vocab_size
    top = [Tensor(EMBED, (vocab, h)), Tensor(FINAL_NORM, (h,))]
    if not cfg.tie_word_embeddings:
        top.append(Tensor(LM_HEAD, (h, vocab)))
    return {t.name: t for t in top}


def model_tensors(cfg: ModelConfig) -> dict:
    """Every tensor of the model, keyed like the params pytree: the top level's, and "layers" a tuple
    of one dict per layer."""
    layer = layer_tensors(cfg)
    return top_tensors(cfg) | {"layers": tuple(dict(layer) for _ in range(cfg.num_layers))}


def each_tensor(cfg: ModelConfig) -> Iterator[tuple[int | None, Tensor]]:
    """Every tensor of the model with its layer's index (None at the top level), the "{i}" of its
    sources' names: what the checkpoint readers look for."""
    yield from ((None, t) for t in top_tensors(cfg).values())
    layer = layer_tensors(cfg)
    for i in range(cfg.num_layers):
        yield from ((i, t) for t in layer.values())
