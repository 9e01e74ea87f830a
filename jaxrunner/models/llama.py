"""The Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) and Gemma 2/3 as pure functions over a
params pytree. Gemma is this decoder with its options (`ModelConfig.gemma`): norms that scale by
1 + weight and a second norm after attention and after the MLP, a scaled embedding, GeGLU, soft-caps,
local and global layers with their own windows and RoPE bases. Mixtral and Qwen3-MoE are this
decoder with `models.moe`'s MLP.

Params are plain dicts, every matrix stored [in, out] (a quantized one as `quantization.Quantized`,
its values and scales). Layers are a tuple of per-layer dicts and
the forward pass unrolls them in Python: XLA then sees one array per layer and never copies a
layer's weights out of a stacked array (a `lax.scan` over stacked weights does, and decode then
runs far slower; docs/design.md). The projections that read the same input are stored side by side (q|k|v,
gate|up): at decode one wide matmul streams its weight faster than two or three narrow ones
(docs/benchmarks.md, `benchmarks/matmul.py`). Which tensors a model has (q/k/v bias, q/k norm, an
untied LM head), their shapes, splits and checkpoint names are declared once in `models.tensors`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxrunner.config import ModelConfig
from jaxrunner.models.moe import GroupedMatmul, moe_mlp
from jaxrunner.models.quantization import Matmul, Quantized, matmul
from jaxrunner.models.row_tiles import summed_in_order
from jaxrunner.models.tensors import MODEL_AXIS, ROWS, Tensor, layer_tensors, model_tensors, top_tensors
from pallas_kernels.common import tree_sum

Params = dict


def fused_parts(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Widths of the side-by-side parts of each fused tensor (along its last axis): q|k|v, gate|up."""
    return {name: t.fused for name, t in layer_tensors(cfg).items() if t.fused}


def param_shapes(cfg: ModelConfig) -> dict:
    """The shape of every tensor, keyed like the params pytree (`tensors.model_tensors`)."""
    return jax.tree.map(lambda t: t.shape, model_tensors(cfg))


def param_specs(cfg: ModelConfig) -> dict:
    """Each tensor's PartitionSpec, keyed like `param_shapes`: its `Weight.split` axis over MODEL_AXIS
    (q|k|v's and gate|up's columns hold each shard's side by side: `ModelConfig.shards`; the
    embedding and the LM head split over `ModelConfig.padded_vocab_size`), the rest replicated."""

    return jax.tree.map(tensor_spec, model_tensors(cfg))


def tensor_spec(t: Tensor) -> P:
    """A tensor's PartitionSpec (`param_specs`)."""
    if t.weight.split is None:
        return t.storage.spec(P(), t.shape)
    axes = [None] * len(t.shape)
    axes[t.weight.split] = MODEL_AXIS
    return t.storage.spec(P(*axes), t.shape)


def param_structs(cfg: ModelConfig, dtype: str, sharding: jax.sharding.Sharding | None = None) -> dict:
    """Every param as its storage's `jax.ShapeDtypeStruct` in `dtype` (on `sharding`): the params
    without data, for ahead-of-time compiles and for restoring saved params into place."""
    return jax.tree.map(lambda t: t.storage.struct(t.shape, dtype, sharding), model_tensors(cfg))


def init_params(cfg: ModelConfig, key: jax.Array, dtype: str = "float32", std: float = 0.02) -> Params:
    """Random weights in the model's shapes (norm weights are ones), for tests and benchmarks.

    Drawn on the device by two jitted programs, the top level's and a layer's (called once a layer):
    one program for the whole model compiled anew on every start and was most of the start-up of
    large shapes (docs/benchmarks.md)."""
    top, layer = top_tensors(cfg), layer_tensors(cfg)
    trees, drawn = [], 0
    for tree in [top] + [layer] * cfg.num_layers:
        trees.append(_draw(key, drawn, tuple(tree.values()), dtype, std))
        drawn += sum(t.weight.init == "normal" for t in tree.values())
    return trees[0] | {"layers": tuple(trees[1:])}


@functools.partial(jax.jit, static_argnames=("tensors", "dtype", "std"))
def _draw(key: jax.Array, first: int, tensors: tuple[Tensor, ...], dtype: str, std: float) -> dict:
    """The n-th tensor drawn from a normal distribution has key fold_in(key, first + n)."""
    out, n = {}, 0
    for t in tensors:
        if t.weight.init == "ones":
            values = jnp.ones(t.shape)
        else:
            values = std * jax.random.normal(jax.random.fold_in(key, first + n), t.shape)
            n += 1
        out[t.name] = t.storage.store(values, dtype)
    return out


def quantize_params(cfg: ModelConfig, params: Params) -> Params:
    """Dense `params` (as a checkpoint loads) held as `cfg` says: its quantized weights converted."""
    return jax.tree.map(lambda t, w: t.storage.store(w, w.dtype), model_tensors(cfg), params)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, gemma: bool = False, ordered: bool = False) -> jax.Array:
    """Llama's RMSNorm (the normalised x cast back, then scaled), or Gemma's (scaled by 1 + weight
    in float32, then cast): the order of the cast is each family's own, which bf16 parity needs.
    `ordered`: the squares summed in a fixed order (`common.tree_sum`), batch-invariant."""
    xf = x.astype(jnp.float32)
    if ordered:
        mean = (tree_sum(xf * xf) / xf.shape[-1])[..., None]
    else:
        mean = jnp.mean(xf * xf, axis=-1, keepdims=True)
    xf = xf * jax.lax.rsqrt(mean + eps)
    if gemma:
        return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * xf.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig, window: int | None = None) -> np.ndarray:
    """Rotary inverse frequencies of a layer with this sliding window (Gemma 3's local layers have
    their own base), with Llama 3's smooth low/high-frequency rescaling or linear scaling when configured."""
    d = cfg.head_dim
    local = window is not None and cfg.local_rope_theta is not None
    theta = cfg.local_rope_theta if local else cfg.rope_theta
    inv_freq = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if local:
        return inv_freq.astype(np.float32)
    inv_freq = inv_freq / cfg.rope_linear_factor
    s = cfg.rope_scaling
    if s is None:
        return inv_freq.astype(np.float32)
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate [T, H, D] by position, halves layout (Hugging Face's rotate_half convention)."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def slot_mask(slots: jax.Array, num_slots: int, dtype) -> jax.Array:
    """[T, L] one-hot of each token's LoRA slot value (0, the base model: an all-zero row)."""
    return (slots[:, None] == jnp.arange(1, num_slots + 1)[None, :]).astype(dtype)


def lora_delta(x: jax.Array, w: dict, mask: jax.Array, matmul: Matmul = matmul) -> jax.Array:
    """The LoRA adapters' addition to `x @ W` [T, out] for one projection held as `models.lora`
    lays it out: every slot's shrink in one matmul, the columns of slots other than the token's
    zeroed by `mask` [T, L], then every slot's expand in one matmul; both through the layer's
    `matmul` (batch-invariant, its tiles)."""
    t, num_slots = mask.shape
    shrunk = matmul(x, w["a"]).reshape(t, num_slots, -1) * mask[:, :, None]
    return matmul(shrunk.reshape(t, -1), w["b"])


Attend = Callable[[jax.Array, jax.Array, jax.Array, tuple, int | None], tuple[jax.Array, tuple]]


def forward(
    params: Params,
    cfg: ModelConfig,
    token_ids: jax.Array,
    positions: jax.Array,
    kv: tuple,
    attend: Sequence[Attend],
    lora: tuple = (),
    lora_mask: jax.Array | None = None,
    valid: jax.Array | None = None,
    grouped_matmul: GroupedMatmul = jax.lax.ragged_dot,
    matmul: Matmul = matmul,
    batch_invariant: bool = False,
) -> tuple[jax.Array, tuple]:
    """Run a packed batch of T tokens; returns the final hidden states [T, H] and the updated KV.
    `lora`: the adapter slots per layer (`models.lora`; () without LoRA), `lora_mask` [T, L] each
    token's slot (`slot_mask`); `valid` [T]: the batch's real tokens (None: all), the rest padding
    that the MoE MLP routes to no expert; `grouped_matmul`: its experts' matmul (`models.moe`);
    `matmul`: the projections' (`quantization.matmul`, with or without its GPU kernel);
    `batch_invariant`: the mode whose `matmul` runs tile by tile (`RunnerConfig.batch_invariant`);
    the rest of each token's bits are then made its own too: the norms sum their squares in a
    fixed order (`common.tree_sum`), under tensor parallelism the
    row-parallel projections add their devices' partial sums in a fixed order
    (`row_parallel_in_order`), and an MoE MLP keeps each token's bits its own (`moe.moe_mlp`).

    `attend[g](q, k, v, kv_layer, window) -> (out [T, Hq, D], kv_layer)` writes this step's keys and
    values into the paged cache of a layer of KV-cache group g and attends over it (over the last
    `window` keys, or all of them for None). Each is a callable pytree (the runner's
    `attention.PagedAttention`, the group's page metadata inside), so the model knows nothing about
    pages and the jitted layer takes it as an argument. `kv` holds one (k, v) per group member
    (`ModelConfig.kv_slot`): the layers at member j of every group share those arrays, each group
    in the blocks it owns.
    """
    x = params["embed"][token_ids]
    if cfg.gemma:  # the scale rounded to the weights' dtype first, as Gemma's embedding does
        x = x * jnp.asarray(cfg.hidden_size**0.5, x.dtype)
    if len(kv) != cfg.group_size or len(attend) != len(cfg.kv_cache_groups):
        raise ValueError(f"the model needs {cfg.group_size} (k, v) page arrays and attention for "
                         f"{len(cfg.kv_cache_groups)} KV-cache groups, got {len(kv)} and {len(attend)}")
    new_kv = list(kv)
    for i, p in enumerate(params["layers"]):
        adapters = lora[i] if lora else {}
        group, member = cfg.kv_slot(i)
        x, new_kv[member] = decoder_layer(p, adapters, x, positions, new_kv[member], attend[group], lora_mask, valid,
                                          cfg=cfg, window=cfg.layer_window(i), grouped_matmul=grouped_matmul,
                                          matmul=matmul, batch_invariant=batch_invariant)
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps, cfg.gemma, batch_invariant), tuple(new_kv)


@functools.partial(jax.jit, static_argnames=("cfg", "window", "grouped_matmul", "matmul", "batch_invariant"))
def decoder_layer(p: dict, lora: dict, x: jax.Array, positions: jax.Array, kv: tuple, attend: Attend,
                  lora_mask: jax.Array | None, valid: jax.Array | None, *, cfg: ModelConfig,
                  window: int | None, grouped_matmul: GroupedMatmul, matmul: Matmul,
                  batch_invariant: bool) -> tuple[jax.Array, tuple]:
    """One layer (`lora`: its adapter slots, {} without LoRA; `window`: its attention's sliding
    window). Jitted, so a step's program traces and lowers it once per kind of layer and calls it
    from every layer: lowering runs in Python and, written out per layer (the Pallas kernels into
    Triton IR each time), was most of start-up. XLA inlines the calls: the compiled step is the same."""

    tensors = layer_tensors(cfg)

    def project(h: jax.Array, name: str) -> jax.Array:
        if batch_invariant and cfg.shards > 1 and tensors[name].weight.split == ROWS:
            out = row_parallel_in_order(matmul, h, p[name], tensor_spec(tensors[name]))
        else:
            out = matmul(h, p[name])
        return out + lora_delta(h, lora[name], lora_mask, matmul) if lora else out

    def norm(h: jax.Array, name: str) -> jax.Array:
        return rms_norm(h, p[name], cfg.rms_norm_eps, cfg.gemma, batch_invariant)

    t, s = x.shape[0], cfg.shards
    d = cfg.head_dim
    q_width, kv_width, _ = fused_parts(cfg)["wqkv"]
    inv_freq = rope_inv_freq(cfg, window)
    h = norm(x, "attn_norm")
    qkv = project(h, "wqkv")
    if cfg.qkv_bias:
        qkv = qkv + p["bqkv"]
    q, k, v = jnp.split(qkv.reshape(t, s, -1), [q_width // s, (q_width + kv_width) // s], axis=-1)
    q = q.reshape(t, cfg.num_heads, d)
    k = k.reshape(t, cfg.num_kv_heads, d)
    v = v.reshape(t, cfg.num_kv_heads, d)
    if cfg.qk_norm:
        q, k = norm(q, "q_norm"), norm(k, "k_norm")
    q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
    o, kv = attend(q, k, v, kv, window)
    o = project(o.reshape(t, cfg.num_heads * d), "wo")
    x = x + (norm(o, "post_attn_norm") if cfg.gemma else o)
    h = norm(x, "mlp_norm")
    act = jax.nn.silu if cfg.hidden_act == "silu" else functools.partial(jax.nn.gelu, approximate=True)
    if cfg.num_experts:
        out = moe_mlp(h, p["router"], p["experts_gate_up"], p["experts_down"], act, cfg, valid, grouped_matmul,
                      batch_invariant)
    else:
        gate_up = project(h, "w_gate_up").reshape(t, s, 2, -1)
        gate, up = gate_up[:, :, 0].reshape(t, -1), gate_up[:, :, 1].reshape(t, -1)
        out = project(act(gate) * up, "w_down")
    return x + (norm(out, "post_mlp_norm") if cfg.gemma else out), kv


def row_parallel_in_order(matmul: Matmul, x: jax.Array, w: jax.Array | Quantized, w_spec) -> jax.Array:
    """x [T, K] @ w [K, N] for a weight split along its rows over MODEL_AXIS (o's and down's, x's
    columns split with them), batch-invariant: each device's partial product added in device order
    (`row_tiles.summed_in_order`), where XLA's partitioner would all-reduce them. fp8 scales each
    device's slice of the tokens by its own maximum (the partitioned form scales by the whole row's)."""
    leaves, tree = jax.tree.flatten(w)
    specs = tree.flatten_up_to(w_spec)
    held = [i for i, leaf in enumerate(leaves) if leaf.size]  # XLA:CPU crashes compiling a zero-size operand

    def local(x: jax.Array, *parts: jax.Array) -> jax.Array:
        arrays = [jnp.zeros(leaf.shape, leaf.dtype) for leaf in leaves]
        for i, part in zip(held, parts):
            arrays[i] = part
        return summed_in_order(matmul(x, tree.unflatten(arrays)), MODEL_AXIS)

    return jax.shard_map(local, in_specs=(P(None, MODEL_AXIS), *(specs[i] for i in held)), out_specs=P(),
                         check_vma=False)(x, *(leaves[i] for i in held))


HeadMatmul = Callable[[jax.Array, jax.Array, bool], jax.Array]  # (x [N, H], head, transposed) -> fp32 [N, V]


def head_product(x: jax.Array, head: jax.Array, transposed: bool) -> jax.Array:
    """x [N, H] times the LM head [H, V], or [V, H] when `transposed` (a tied head is the embedding
    as it is held): fp32 [N, V]."""
    return jnp.dot(x, head.T if transposed else head, preferred_element_type=jnp.float32)


def compute_logits(params: Params, cfg: ModelConfig, hidden: jax.Array, product: HeadMatmul = head_product) -> jax.Array:
    """fp32 logits [N, padded_vocab_size] for the given final hidden states; `product` runs the head
    (batch-invariant, in fixed tiles: `step.logits_matmul`)."""
    tied = cfg.tie_word_embeddings
    logits = product(hidden, params["embed"] if tied else params["lm_head"], tied)
    if cfg.final_soft_cap is not None:
        logits = cfg.final_soft_cap * jnp.tanh(logits / cfg.final_soft_cap)
    return logits
