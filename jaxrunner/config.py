"""Model and runner configuration.

`ModelConfig` is read from a Hugging Face `config.json` (through `transformers.AutoConfig`) and is
hashable, so jitted functions take it as a static argument. `RunnerConfig` sizes the runner: request
slots, token budget, KV cache and the compilation buckets derived from them, the sampler's limits
(`SamplerConfig`) and which kernels run (`Kernels`, resolved once from `RunnerConfig.kernels`).
Every rule between its fields is `RunnerConfig.__post_init__`'s and every rule between it and the
model its `check_model`'s, stated nowhere else: the engine builds a RunnerConfig and lets it raise.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import jax.numpy as jnp

from jaxrunner import platform

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
)
LAYER_TYPES = ("full_attention", "sliding_attention")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
QUANTIZATION_FORMATS = ("fp8", "int8", "int4")  # vLLM's `quantization=` names (`models.quantization`)
_GROUPS = {"int8": 128, "int4": 32}  # the most rows of K that share a scale


def check_quantization(quantization: object) -> None:
    if quantization is not None and quantization not in QUANTIZATION_FORMATS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_FORMATS)} (or unset), got {quantization!r}")


def quantization_group(k: int, fmt: str) -> int:
    """Rows of K that share a scale in format `fmt`: all of them for fp8 (a scale per output column),
    else the largest divisor of K up to the format's group (int8 on a model whose K is not a multiple
    of 128, such as SmolLM2's 576, gets 64)."""
    return k if fmt == "fp8" else math.gcd(k, _GROUPS[fmt])


@dataclass(frozen=True)
class WeightFormat:
    """How one of the layers' quantized weights is held: by default as `ModelConfig.quantization`
    says (`ModelConfig.weight_format`); a GGUF file's conversion keeps each weight as its blocks hold
    it instead (`checkpoints.gguf_blocks`), which its config records (`quantization_config`)."""

    weight: str  # its params key: wqkv, wo, w_gate_up or w_down (`models.tensors`)
    format: str  # one of QUANTIZATION_FORMATS
    group: int  # rows of K that share a scale (and an offset)
    offsets: bool  # w = scale * q + offset per group; else w = scale * q

    def __post_init__(self) -> None:
        if (self.format not in QUANTIZATION_FORMATS or not isinstance(self.group, int) or self.group < 1
                or not isinstance(self.offsets, bool) or self.format == "int4" and not self.offsets
                or self.format == "fp8" and self.offsets):
            raise ValueError(f"weight format {self} cannot be held: the format must be one of "
                             f"{', '.join(QUANTIZATION_FORMATS)}, the group a positive int, and offsets a bool "
                             "(always for int4, never for fp8)")


def default_weight_format(weight: str, fmt: str, k: int) -> WeightFormat:
    """How format `fmt` holds a weight of K rows quantized from its floats: in `quantization_group`s,
    with offsets for int4."""
    return WeightFormat(weight, fmt, quantization_group(k, fmt), fmt == "int4")


def quantization_config(fmt: str, weights: tuple[WeightFormat, ...] = ()) -> dict:
    """The `quantization_config` of a checkpoint jaxrunner writes in its own formats, which
    `checkpoint_quantization` and `checkpoint_weight_formats` read back."""
    held = {w.weight: {"format": w.format, "group": w.group, "offsets": w.offsets} for w in weights}
    return {"quant_method": "jaxrunner", "format": fmt} | ({"weights": held} if held else {})


def checkpoint_weight_formats(spec: dict | None) -> tuple[WeightFormat, ...]:
    """The weights a jaxrunner checkpoint holds otherwise than its format's default, from its
    `quantization_config` (`quantization_config`); () for any other checkpoint."""
    spec = spec if spec is None or isinstance(spec, dict) else spec.to_dict()
    if not spec or spec.get("quant_method") != "jaxrunner":
        return ()
    try:
        return tuple(WeightFormat(name, w["format"], w["group"], w["offsets"]) for name, w in spec.get("weights", {}).items())
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"quantization_config's weights must map each weight to its format, group and offsets "
                         f"({type(e).__name__}: {e}); got {spec.get('weights')!r}") from None


def checkpoint_quantization(spec: dict | None) -> str | None:
    """The format of a checkpoint's quantized weights, from its config's `quantization_config`: fp8
    as compressed-tensors stores it (RedHatAI's releases: e4m3 per channel or per tensor) or as
    "fp8" (Qwen's: e4m3 in 128 x 128 blocks), or one of our formats as jaxrunner's own conversions
    store it ({"quant_method": "jaxrunner", "format": "int4"}). Other methods are named in a ValueError."""
    if spec is None:
        return None
    spec = spec if isinstance(spec, dict) else spec.to_dict()
    method = spec.get("quant_method")
    if method == "jaxrunner" and spec.get("format") in QUANTIZATION_FORMATS:
        return spec["format"]
    if method == "fp8" and spec.get("fmt", "e4m3") == "e4m3":
        return "fp8"
    if method == "compressed-tensors":
        weights = [g.get("weights") or {} for g in (spec.get("config_groups") or {}).values()]
        if weights and all(w.get("type") == "float" and w.get("num_bits") == 8 for w in weights):
            return "fp8"
    raise ValueError(f"checkpoints quantized with {method!r} cannot be read yet; jaxrunner reads "
                     "fp8 checkpoints (compressed-tensors or Qwen's fp8) and quantizes dense ones itself "
                     "(quantization=fp8, int8 or int4)")

@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 frequency scaling ("rope_type": "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    # Per layer "full_attention" or "sliding_attention" (Gemma); () when every layer is alike, all of
    # them then sliding if sliding_window is set (Mistral).
    layer_types: tuple[str, ...] = ()
    local_rope_theta: float | None = None  # the sliding layers' own RoPE base (Gemma 3)
    rope_linear_factor: float = 1.0  # "linear" RoPE: positions divided by it (Gemma 3's global layers)
    attn_soft_cap: float | None = None  # attention scores capped to soft_cap * tanh(s / soft_cap) (Gemma 2)
    final_soft_cap: float | None = None  # the same for the logits (Gemma 2)
    query_pre_attn_scalar: float | None = None  # the scores scale by its -1/2 power, not head_dim's (Gemma)
    hidden_act: str = "silu"  # of the gated MLP: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    # Mixture-of-Experts (Mixtral, Qwen3-MoE): every layer's MLP is num_experts experts of width
    # intermediate_size, each token through its num_experts_per_tok best by the router's softmax,
    # the chosen weights renormalised to sum to one when norm_topk_prob. 0 experts: a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Tensor parallelism (set by the runner): the fused tensors hold, side by side, this many shards,
    # each its own heads' q|k|v and its own slice of gate|up (`parallel.shard_layout`); the embedding
    # and the LM head hold `padded_vocab_size` tokens.
    shards: int = 1
    # How the layers' linear weights are held (`models.quantization`): None (the runner's dtype),
    # "fp8", "int8" or "int4". The embedding, the LM head, the norms and the MoE experts stay dense.
    quantization: str | None = None
    # The weights held otherwise than `quantization`'s default (`weight_format`).
    weight_formats: tuple[WeightFormat, ...] = ()

    def __post_init__(self) -> None:
        check_quantization(self.quantization)
        if self.weight_formats and self.quantization is None:
            raise ValueError("weight_formats are given but quantization is not set")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.layer_types and (len(self.layer_types) != self.num_layers or set(self.layer_types) - set(LAYER_TYPES)):
            raise ValueError(f"layer_types must name {self.num_layers} layers, each one of {', '.join(LAYER_TYPES)}; "
                             f"got {list(self.layer_types)}")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..{self.num_experts}, got {self.num_experts_per_tok}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden activation {self.hidden_act!r}; supported: {', '.join(ACTIVATIONS)}")

    @property
    def padded_vocab_size(self) -> int:
        """The vocabulary rounded up to a multiple of `shards`, so that every shard holds an equal slice
        of the embedding and the LM head (vLLM pads its vocab-parallel layers the same way); the
        padding's logits are cut off before anything reads them (`step.full_logits`)."""
        return -(-self.vocab_size // self.shards) * self.shards

    def weight_format(self, weight: str, k: int) -> WeightFormat:
        """How the layers' weight `weight` (K rows) is held: as `weight_formats` says, else in
        `quantization`'s default groups (offsets for int4)."""
        for held in self.weight_formats:
            if held.weight == weight:
                return held
        return default_weight_format(weight, self.quantization, k)

    @property
    def gemma(self) -> bool:
        """Gemma's decoder: norms that scale by 1 + weight, a norm after attention and after the MLP
        as well as before, the embedding scaled by sqrt(hidden_size)."""
        return self.architecture.startswith("Gemma")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of a layer's attention, None for full attention."""
        if self.layer_types and self.layer_types[layer] == "full_attention":
            return None
        return self.sliding_window

    @property
    def kv_cache_groups(self) -> tuple[tuple[int, ...], ...]:
        """The layers of each KV-cache group, full-attention groups first.

        Layers of one group share a block table, so a request holds one list of blocks per group and a
        sliding group can give back the blocks its window has left behind. Every group has at most
        `group_size` layers (the smaller of the two kinds' counts, as vLLM's hybrid allocator), and
        member j of every group keeps its pages in the same arrays: one block id then means the same
        number of bytes in any group, and all groups draw on one pool of blocks.
        """
        kinds = ([i for i in range(self.num_layers) if self.layer_window(i) is None],
                 [i for i in range(self.num_layers) if self.layer_window(i) is not None])
        size = self.group_size
        return tuple(tuple(layers[i : i + size]) for layers in kinds for i in range(0, len(layers), size))

    @property
    def group_size(self) -> int:
        """Layers per KV-cache group, hence the number of (k, v) page arrays of the cache."""
        full = sum(self.layer_window(i) is None for i in range(self.num_layers))
        return min(full, self.num_layers - full) or self.num_layers

    @property
    def group_windows(self) -> tuple[int | None, ...]:
        """The sliding window of each KV-cache group's layers (None: full attention)."""
        return tuple(self.layer_window(layers[0]) for layers in self.kv_cache_groups)

    def kv_slot(self, layer: int) -> tuple[int, int]:
        """(group, member) of a layer: its block table and its (k, v) page arrays."""
        for g, layers in enumerate(self.kv_cache_groups):
            if layer in layers:
                return g, layers.index(layer)
        raise ValueError(f"layer {layer} out of range: the model has {self.num_layers} layers")

    @classmethod
    def from_hf(cls, path: str | os.PathLike) -> ModelConfig:
        """Read `config.json` from a local checkpoint directory."""
        from transformers import AutoConfig

        path = os.fspath(path)
        config_path = os.path.join(path, "config.json")
        if not os.path.isdir(path):
            raise ValueError(f"model directory {path!r} does not exist (pass a local Hugging Face checkpoint)")
        if not os.path.isfile(config_path):
            raise ValueError(f"{path!r} has no config.json: is it a Hugging Face checkpoint directory?")
        try:
            hf = AutoConfig.from_pretrained(path, local_files_only=True)
        except Exception as e:  # transformers and huggingface_hub raise many kinds; all mean "unreadable"
            reason = " ".join(str(e).split())
            raise ValueError(f"cannot read {config_path!r}: {reason:.300}") from None
        try:
            return cls.from_hf_config(hf)
        except (AttributeError, KeyError, TypeError) as e:
            raise ValueError(f"{config_path!r} does not describe a model jaxrunner can run: {e}") from None

    @classmethod
    def from_hf_config(cls, hf) -> ModelConfig:
        archs = list(getattr(hf, "architectures", None) or [])
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or hf.model_type!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        local_rope = None
        if set(rope) <= set(LAYER_TYPES) and rope:  # one set of parameters per layer type (Gemma 3)
            rope, local_rope = dict(rope.get("full_attention", {})), rope.get("sliding_attention")
            if local_rope is not None and local_rope.get("rope_type", "default") != "default":
                raise ValueError(f"unsupported rope_type {local_rope['rope_type']!r} for sliding layers; supported: 'default'")
        rope_type = rope.get("rope_type", "default")
        if rope_type not in ("default", "llama3", "linear"):
            raise ValueError(f"unsupported rope_type {rope_type!r}; supported: 'default', 'llama3', 'linear'")
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        eos = hf.eos_token_id
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        window = getattr(hf, "sliding_window", None)
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not getattr(hf, "use_sliding_window", False):
            window = None  # Qwen configs carry a window size even when sliding attention is off
        layer_types = tuple(getattr(hf, "layer_types", None) or ()) if window is not None else ()
        if layer_types and "full_attention" not in layer_types:
            layer_types = ()  # every layer slides: the Mistral case
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        num_experts = getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", None) or 0
        intermediate = hf.intermediate_size
        if arch == "Qwen3MoeForCausalLM":
            if getattr(hf, "mlp_only_layers", None) or getattr(hf, "decoder_sparse_step", 1) != 1:
                raise ValueError("Qwen3-MoE checkpoints with dense layers (mlp_only_layers, decoder_sparse_step > 1) "
                                 "are not supported: jaxrunner runs every layer's MLP as experts")
            intermediate = hf.moe_intermediate_size
        return cls(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=intermediate,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.rms_norm_eps),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            rope_linear_factor=float(rope["factor"]) if rope_type == "linear" else 1.0,
            local_rope_theta=None if local_rope is None else float(local_rope.get("rope_theta", 10000.0)),
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(getattr(hf, "attention_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            sliding_window=window,
            layer_types=layer_types,
            attn_soft_cap=getattr(hf, "attn_logit_softcapping", None),
            final_soft_cap=getattr(hf, "final_logit_softcapping", None),
            query_pre_attn_scalar=getattr(hf, "query_pre_attn_scalar", None),
            hidden_act=getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu"),
            num_experts=num_experts,
            num_experts_per_tok=getattr(hf, "num_experts_per_tok", 0) if num_experts else 0,
            norm_topk_prob=arch == "MixtralForCausalLM" or bool(getattr(hf, "norm_topk_prob", True)),
            bos_token_id=hf.bos_token_id,
            eos_token_ids=eos_ids,
            quantization=checkpoint_quantization(getattr(hf, "quantization_config", None)),
            weight_formats=checkpoint_weight_formats(getattr(hf, "quantization_config", None)),
        )


def _powers(lo: int, hi: int, factor: int = 2) -> tuple[int, ...]:
    """lo, lo * factor, ... below hi, then hi."""
    sizes, n = [], lo
    while n < hi:
        sizes.append(n)
        n *= factor
    return tuple(sizes) + (hi,)


LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@dataclass(frozen=True)
class SamplerConfig:
    """Engine-wide sampler settings, fixed for the runner's lifetime.

    `max_logprobs` bounds what a request may ask for (-1: the whole vocabulary); every row that
    wants logprobs gets that many top columns and the host keeps each row's own count.
    `logprobs_mode`: raw_logprobs, raw_logits, processed_logprobs or processed_logits (processed:
    after the sampling parameters). The `max_*` widths bound the per-request lists (vLLM's limits;
    bad words are jaxrunner's own): the sampler's arrays have these widths when a batch needs them.
    """

    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"
    count_nans: bool = True
    max_logit_bias: int = 1024
    max_allowed_token_ids: int = 1024
    max_stop_token_ids: int = 128
    max_bad_words: int = 128
    max_bad_word_len: int = 8

    def __post_init__(self) -> None:
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (whole vocabulary) or >= 0, got {self.max_logprobs}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        for name in ("max_logit_bias", "max_allowed_token_ids", "max_stop_token_ids", "max_bad_words", "max_bad_word_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    def logprobs_width(self, vocab_size: int) -> int:
        """Top-logprob columns computed beside the sampled token's when some row wants logprobs."""
        return vocab_size if self.max_logprobs == -1 else min(self.max_logprobs, vocab_size)


SPEC_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`); `num_speculative_tokens` = 0: off.

    Each decode step of a request verifies up to `num_speculative_tokens` (k) draft tokens in one
    forward pass of 1 + k query tokens, and keeps 1 to k + 1 tokens. The drafts are made on the
    device right after each step's sampling: "ngram" looks the request's last `prompt_lookup_max`
    down to `prompt_lookup_min` tokens up in its earlier tokens and proposes what followed them;
    "draft_model" runs `model` (a smaller checkpoint with the target's vocabulary) k steps ahead.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None

    def __post_init__(self) -> None:
        where = "speculative_config"
        if self.method not in SPEC_METHODS:
            raise ValueError(f"{where}: method must be one of {', '.join(SPEC_METHODS)}, got {self.method!r}")
        for name, low in (("num_speculative_tokens", 0), ("prompt_lookup_max", 1), ("prompt_lookup_min", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{where}: {name} must be an integer >= {low}, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"{where}: prompt_lookup_min={self.prompt_lookup_min} exceeds "
                             f"prompt_lookup_max={self.prompt_lookup_max}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(f"{where}: method 'draft_model' needs model=DIR (a checkpoint with the target's "
                             "vocabulary), and only it takes a model")

    @classmethod
    def from_dict(cls, config: dict) -> SpeculativeConfig:
        """vLLM's dict form; "num_speculative_tokens" is required, as there."""
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(config).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        if unknown := sorted(set(config) - known):
            raise ValueError(f"speculative_config: unsupported keys {unknown}; jaxrunner takes {sorted(known)}")
        if "num_speculative_tokens" not in config:
            raise ValueError("speculative_config needs num_speculative_tokens")
        if config.get("method", "ngram") == "draft_model" and "model" not in config:
            raise ValueError("speculative_config: method 'draft_model' needs model=DIR")
        return cls(**config)

    @property
    def enabled(self) -> bool:
        return self.num_speculative_tokens > 0

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a step writes past its scheduled tokens: the draft model's k proposals (it computes
        the KV of the last kept token and of its first k - 1 drafts); their blocks must be there."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0


@dataclass(frozen=True)
class LoraConfig:
    """Multi-LoRA (vLLM's `enable_lora`, `max_loras`, `max_lora_rank`); `max_loras` = 0: off.

    The device holds `max_loras` adapter slots, every one `max_lora_rank` wide for every projection
    (q, k, v, o, gate, up, down): programs are compiled once for that, whichever adapters come and
    go. `max_cpu_loras` bounds the adapters kept parsed on the host (at least `max_loras`).
    """

    max_loras: int = 0
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name, low in (("max_loras", 0), ("max_lora_rank", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        cpu = self.max_cpu_loras
        if cpu is not None and (not isinstance(cpu, int) or isinstance(cpu, bool) or cpu < self.max_loras):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras={self.max_loras}, got {cpu!r}")

    @property
    def enabled(self) -> bool:
        return self.max_loras > 0

    @property
    def host_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else max(self.max_loras, 1)


KERNEL_CHOICES = ("auto", "pallas", "mosaic", "reference")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


@dataclass(frozen=True)
class Kernels:
    """Which implementation the kernels use, decided once per runner: a static argument of every
    program that runs one. `pallas`: the Pallas kernels (attention, KV write, sampler tally), else
    their jnp references; `interpret`: Pallas in interpret mode (a machine without a GPU);
    `num_sms`: the GPU's streaming multiprocessors, which set the decode attention's KV splits;
    `batch_invariant`: the matmuls whose row count is the batch's run tile by tile
    (`models.row_tiles`), so a row's bits do not depend on the batch (`RunnerConfig.batch_invariant`);
    `mosaic`: the Mosaic GPU kernels where they take the call, the Triton ones elsewhere: batches
    that are not all decodes attend through `pallas_kernels.mosaic_attention`, and an MoE decode's
    experts run `quantized_matmul.grouped_dense_matmul`."""

    pallas: bool
    interpret: bool
    num_sms: int
    batch_invariant: bool = False
    mosaic: bool = False

    @classmethod
    def choose(cls, choice: str, batch_invariant: bool = False) -> Kernels:
        """"auto": Pallas on a GPU, the references elsewhere; "pallas" off a GPU runs interpreted;
        "mosaic": "pallas" with the Mosaic GPU kernels (`mosaic`; the mode has no Mosaic form yet:
        with `batch_invariant` it is "pallas"). `choice` is a `RunnerConfig.kernels`, checked there."""
        gpu = platform.on_gpu()
        return cls(pallas=choice in ("pallas", "mosaic") or (choice == "auto" and gpu), interpret=not gpu,
                   num_sms=platform.num_sms(), batch_invariant=batch_invariant,
                   mosaic=choice == "mosaic" and not batch_invariant)


@dataclass(frozen=True)
class RunnerConfig:
    """Sizes of the runner.

    `max_num_seqs` request slots, each up to `max_model_len` tokens; at most `max_num_batched_tokens`
    tokens per step; a paged KV cache of `num_blocks` blocks of `block_size` tokens.
    `num_scheduler_steps`: the decode steps of a multi-step call (warm-up compiles its loop).
    `speculative`: speculative decoding (not with multi-step decode). `lora`: multi-LoRA slots.
    `tensor_parallel_size`: devices the model is split over (`parallel`); `data_parallel_size`
    replicas of the runner, this one `data_parallel_rank`, on devices [rank * tp, (rank + 1) * tp).
    `kv_cache_dtype`: "auto" keeps the pages in `dtype`; "fp8" (or "fp8_e4m3") stores them as float8
    e4m3, keys and values divided by `kv_scales` (vLLM's k_scale and v_scale) as they are written
    and multiplied back as attention reads them: half of bf16's bytes, so twice the blocks.
    `kernels`: "auto", "pallas", "mosaic" or "reference" (see `Kernels.choose`). `compilation_cache_dir` turns
    on JAX's persistent compilation cache (process-wide) there, and the runner's program cache in
    its `programs` folder (`program_cache`: found without lowering). `batch_invariant`: a request's
    tokens and logprobs do not depend on the batch it runs in (`Kernels.batch_invariant`; under
    tensor parallelism with its partial sums added in a fixed order, MoE models' grouped matmul in
    fixed tiles, a draft model's drafts verified as n-gram drafts are). `num_host_blocks`: the
    blocks of the prefix cache's host tier (`runner.host_kv`; 0: none).
    """

    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    max_model_len: int = 512
    block_size: int = 16
    num_blocks: int = 256
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"
    kv_scales: tuple[float, float] = (1.0, 1.0)
    seed: int = 0
    num_scheduler_steps: int = 1
    sampler: SamplerConfig = SamplerConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    lora: LoraConfig = LoraConfig()
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    kernels: str = "auto"
    compilation_cache_dir: str | None = None
    token_buckets: tuple[int, ...] = field(default=())
    request_buckets: tuple[int, ...] = field(default=())
    batch_invariant: bool = False
    num_host_blocks: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "num_blocks",
                     "num_scheduler_steps", "tensor_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"RunnerConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.max_num_seqs > self.max_num_batched_tokens:  # a step schedules a token per request at least
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be at least max_num_seqs="
                             f"{self.max_num_seqs}: a decode step schedules one token per request; raise "
                             "max_num_batched_tokens or lower max_num_seqs")
        if not isinstance(self.num_host_blocks, int) or self.num_host_blocks < 0:
            raise ValueError(f"RunnerConfig.num_host_blocks must be an integer of at least 0, got {self.num_host_blocks!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"RunnerConfig.dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if len(self.kv_scales) != 2 or not all(0 < float(x) < float("inf") for x in self.kv_scales):
            raise ValueError(f"kv_scales must be two positive finite numbers (K's and V's), got {self.kv_scales!r}")
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}, got {self.kernels!r}")
        rank = self.data_parallel_rank
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_rank must be an integer in [0, data_parallel_size={self.data_parallel_size}), "
                             f"got {rank!r}")
        split = self.tensor_parallel_size > 1 or self.data_parallel_size > 1
        if split and (self.lora.enabled or self.speculative.enabled and self.speculative.method == "draft_model"):
            raise ValueError("tensor and data parallelism do not combine with LoRA or a draft model yet; "
                             "use tensor_parallel_size=1 and data_parallel_size=1 for them")
        if self.speculative.enabled and self.num_scheduler_steps > 1:
            raise ValueError("speculative decoding and multi-step decode (num_scheduler_steps > 1) do not combine; "
                             "use one of them")
        if not self.token_buckets:
            lo = min(16, self.max_num_batched_tokens)
            object.__setattr__(self, "token_buckets", _powers(lo, self.max_num_batched_tokens))
        if not self.request_buckets:  # powers of 4 from the token buckets' floor: a sampler's rows cost
            # little (up to hundreds, its LM head reads the head's bytes whatever their number), its
            # programs' start-up much
            object.__setattr__(self, "request_buckets", _powers(min(16, self.max_num_seqs), self.max_num_seqs, 4))

    def check_model(self, model: ModelConfig, draft: ModelConfig | None = None) -> None:
        """Raise a ValueError naming what keeps this config from running `model` (as its checkpoint
        describes it, before any split) with `draft`, the draft model of speculative method
        "draft_model". The one home of the rules between the config and the models: the runner asks
        it, and the engine before it loads the draft's weights."""
        spec = self.speculative
        if (spec.enabled and spec.method == "draft_model") != (draft is not None):
            raise ValueError("a draft model goes with speculative decoding of method 'draft_model', and that needs one: "
                             "pass draft=(config, params)")
        if draft is not None and draft.vocab_size != model.vocab_size:
            raise ValueError(f"speculative_config: the draft model {spec.model!r} has {draft.vocab_size} tokens, the "
                             f"target {model.vocab_size}; the draft model must share the target's vocabulary (its tokenizer)")
        if draft is not None and not _draft_fits(model, draft):
            raise ValueError(f"a draft model reads the target's block table, so both need one KV-cache group and the "
                             f"draft a window no wider than the target's; the target has {len(model.kv_cache_groups)} "
                             f"groups (window {model.sliding_window}), the draft {len(draft.kv_cache_groups)} "
                             f"(window {draft.sliding_window}); use ngram speculation for this model")
        if self.tensor_parallel_size > 1:
            _check_split(model, self.tensor_parallel_size)

    @property
    def jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def kv_dtype(self) -> jnp.dtype:
        """The KV pages' dtype."""
        return self.jnp_dtype if self.kv_cache_dtype == "auto" else jnp.dtype(jnp.float8_e4m3fn)

    @property
    def max_blocks_per_req(self) -> int:
        return -(-self.max_model_len // self.block_size)


def _draft_fits(target: ModelConfig, draft: ModelConfig) -> bool:
    """Whether the draft's layers can read the blocks the target's one group keeps."""
    if len(target.kv_cache_groups) != 1 or len(draft.kv_cache_groups) != 1:
        return False
    (window,), (draft_window,) = target.group_windows, draft.group_windows
    return window is None or draft_window is not None and draft_window <= window


def _check_split(model: ModelConfig, tp: int) -> None:
    """One ValueError naming every size of the model that `tp` shards cannot split (each shard holds
    whole heads, and an MoE model's whole experts: `runner.parallel`)."""
    split = ("num_local_experts", model.num_experts) if model.num_experts else ("intermediate_size", model.intermediate_size)
    problems = [f"{name}={size}" for name, size in (("num_attention_heads", model.num_heads), split) if size % tp]
    kv = model.num_kv_heads
    if kv % tp if kv >= tp else tp % kv:
        problems.append(f"num_key_value_heads={kv} (neither a multiple nor a divisor of {tp})")
    if model.quantization:  # o and down split along K: their scales' groups (if several) with it
        for name, weight, k in (("o_proj", "wo", model.num_heads * model.head_dim),
                                ("down_proj", "w_down", model.intermediate_size)):
            held = model.weight_format(weight, k)
            groups = k // held.group
            if groups > 1 and groups % tp:
                problems.append(f"{name}'s {groups} {held.format} groups of {held.group} rows")
    if problems:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {', '.join(problems)}; "
                         "choose a tensor_parallel_size that divides them")
