"""Quantized weights: a linear weight held in fewer bits, and the matmul that reads it.

Formats (vLLM's `quantization=` names):
- "int8": weight-only (w8a16). Symmetric int8 in groups of up to 128 rows along the input axis K,
  each group with a scale per output column.
- "int4": weight-only (w4a16). Asymmetric: uint4 in groups of 32 rows, each group with a scale and
  an offset per output column (w = scale * q + offset). That holds llama.cpp's 4-bit blocks (32
  weights with a scale, and for Q4_1 and Q4_K a minimum), so a GGUF file's 4-bit weights load as
  they are (`checkpoints.gguf_blocks`);
  groups of 64 lost a third in perplexity on SmolLM2's Q4_1 weights, where 32 lost nothing
  (docs/benchmarks.md).
- "fp8": W8A8 for Hopper's fp8 tensor cores. e4m3 weights with one scale per output column;
  activations are scaled per token as the matmul runs (their absolute maximum over K maps to e4m3's
  largest value), the dot runs in fp8 accumulating in float32, and both scales multiply its result.
A weight may also be held in other groups, and int8 with offsets (`config.WeightFormat`): how a
GGUF file's 5- to 8-bit blocks hold their weights (int8 in groups of 32 or 16, with or without a
minimum), which its conversion keeps as they are.
The activations stay in the runner's dtype for the weight-only formats: their matmul widens the
weight to it. Scales and offsets are float32: an eighth of int8's bytes in groups of 128, half of
them in a GGUF file's groups of 16 with offsets.

The values are held K-major, [..., N, K] (as Hugging Face stores a linear weight, and as Hopper's
tensor cores read an fp8 operand), the scales [..., G, N]. On a GPU, decode-shaped calls (a few
token rows) of fp8 and int8 run the Mosaic kernel `pallas_kernels.quantized_matmul`, which reads
the weight once as stored (XLA widens int8 in memory first, and tiles fp8 for more rows than a
decode has); the rest run through XLA.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxrunner.config import quantization_group
from jaxrunner.pytree import pytree_dataclass
from pallas_kernels import quantized_matmul

FP8_MAX = quantized_matmul.FP8_MAX  # e4m3's largest value


@pytree_dataclass
class Quantized:
    """A quantized weight W [..., K, N]: `values` [..., N, K] (W transposed) in the format's dtype,
    `scales` float32 [..., G, N] (G = K / group size; 1 for fp8), `offsets` float32 like `scales`
    where the weight is held with them (int4's; [0] for a symmetric form)."""

    values: jax.Array
    scales: jax.Array
    offsets: jax.Array


Matmul = Callable[..., jax.Array]  # (x [T, K], w [K, N] dense or `Quantized`) -> [T, N], as `matmul`


def storage_dtype(fmt: str) -> jnp.dtype:
    return jnp.dtype({"fp8": jnp.float8_e4m3fn, "int8": jnp.int8, "int4": jnp.uint4}[fmt])


@dataclass(frozen=True)
class QuantizedStorage:
    """How a quantized weight is held (`models.tensors.Tensor.storage`): the counterpart of `Dense`
    with the same methods: the arrays it holds, their PartitionSpecs, and how it quantizes. Its
    fields are a `config.WeightFormat`'s."""

    format: str
    group: int  # rows of K that share a scale (and an offset)
    offsets: bool

    def struct(self, shape: tuple[int, ...], dtype: str,
               sharding: jax.sharding.Sharding | None = None) -> Quantized:
        *lead, k, n = shape
        scales = (*lead, k // self.group, n)
        offsets = scales if self.offsets else (0,)
        return Quantized(jax.ShapeDtypeStruct((*lead, n, k), storage_dtype(self.format), sharding=sharding),
                         jax.ShapeDtypeStruct(scales, jnp.float32, sharding=sharding),
                         jax.ShapeDtypeStruct(offsets, jnp.float32, sharding=sharding if self.offsets else None))

    def store(self, values: jax.Array | np.ndarray, dtype: str) -> Quantized:
        """`values` [..., K, N] quantized."""
        return quantize(values, self.format, self.group, self.offsets)

    def spec(self, spec: P, shape: tuple[int, ...]) -> Quantized:
        """The arrays split like the weight (the values' last two axes swapped), the scales' groups
        with K; one group (fp8's, or int8's on a small K) cannot split, so every shard of a weight
        split along K holds it whole."""
        spec = P(*spec, *(None,) * (len(shape) - len(spec)))
        scales = P(*spec[:-2], None, spec[-1]) if self.group == shape[-2] else spec
        return Quantized(P(*spec[:-2], spec[-1], spec[-2]), scales, scales if self.offsets else P())


@functools.partial(jax.jit, static_argnames=("fmt", "group", "offsets"))
def quantize(w: jax.Array | np.ndarray, fmt: str, group: int = 0, offsets: bool | None = None) -> Quantized:
    """Float `w` [..., K, N] in groups of `group` rows (by default `quantization_group(K)`):
    symmetric (fp8; int8 by default), or with `offsets` (int4 always) from each group's minimum in
    equal steps to its maximum; from float32, so a bf16 checkpoint loses nothing more.

    One program, not op by op: the float32 temporaries of a weight then live inside it, not as
    device arrays of their own allocated between the quantized weights a model's load makes."""
    w = w.astype(jnp.float32)
    *lead, k, n = w.shape
    g = group or quantization_group(k, fmt)
    asymmetric = fmt == "int4" if offsets is None else offsets
    if asymmetric != (fmt == "int4") and fmt != "int8" or k % g:
        raise ValueError(f"cannot quantize a weight of {k} rows to {fmt} in groups of {g} rows "
                         f"{'with' if asymmetric else 'without'} offsets: int4 has offsets, fp8 none, and the "
                         "groups must divide the rows")
    grouped = w.reshape(*lead, k // g, g, n)
    lowest, highest = {"int4": (0, 15), "int8": (-128, 127), "fp8": (-FP8_MAX, FP8_MAX)}[fmt]
    if asymmetric:
        low, high = jnp.min(grouped, axis=-2), jnp.max(grouped, axis=-2)
        steps = (high - low) / (highest - lowest)
    else:
        steps = jnp.max(jnp.abs(grouped), axis=-2) / (FP8_MAX if fmt == "fp8" else 127.0)
    scales = jnp.where(steps > 0, steps, 1.0)  # a constant group: any scale holds it
    shifts = low - lowest * steps if asymmetric else jnp.zeros((0,))  # a constant group: q = 0 holds it exactly
    scaled = (grouped - (shifts[..., None, :] if asymmetric else 0.0)) / scales[..., None, :]
    if fmt != "fp8":
        scaled = jnp.clip(jnp.round(scaled), lowest, highest)
    values = scaled.astype(storage_dtype(fmt)).reshape(w.shape)
    return Quantized(jnp.swapaxes(values, -1, -2), scales.astype(jnp.float32), shifts.astype(jnp.float32))


def widened(w: Quantized, storage: QuantizedStorage) -> Quantized:
    """`w` held exactly in `storage`, whose values hold w's and whose group divides w's (a GGUF
    block's weight joining wider ones: `checkpoints.loader`): the values widened, the scales (and
    offsets) repeated for the finer groups, offsets of zero added, or for int4, symmetric values
    (-8..7) moved to 0..15 by an offset of -8 steps (exact for scales of float16's precision, as a
    GGUF file's: every product and sum then as exact as before)."""
    values, scales, offsets = (jnp.asarray(a) for a in (w.values, w.scales, w.offsets))
    group = values.shape[-1] // scales.shape[-2]
    if group % storage.group or offsets.size and not storage.offsets:
        raise ValueError(f"a weight in groups of {group} rows{' with offsets' if offsets.size else ''} cannot be "
                         f"held exactly as {storage}")
    if storage.offsets and not offsets.size:
        if storage.format == "int4":
            values, offsets = values.astype(jnp.int8) + 8, -8 * scales
        else:
            offsets = jnp.zeros_like(scales)
    repeat = group // storage.group
    scales, offsets = (jnp.repeat(a, repeat, axis=-2) if a.size else a for a in (scales, offsets))
    return Quantized(values.astype(storage_dtype(storage.format)), scales, offsets)


def dequantize(w: Quantized, dtype) -> jax.Array:
    """The weight in `dtype` [..., K, N]."""
    values = jnp.swapaxes(w.values, -1, -2)
    *lead, k, n = values.shape
    groups = w.scales.shape[-2]
    grouped = values.astype(jnp.float32).reshape(*lead, groups, k // groups, n) * w.scales[..., None, :]
    if w.offsets.size:
        grouped = grouped + w.offsets[..., None, :]
    return grouped.reshape(values.shape).astype(dtype)


def map_columns(f: Callable[[jax.Array], jax.Array], w: jax.Array | Quantized) -> jax.Array | Quantized:
    """`f`, which regroups an array's last axis (a weight's output columns), applied to a weight
    dense or quantized: to its values' N axis and to its scales' and offsets' columns alike."""
    if not isinstance(w, Quantized):
        return f(w)
    values = jnp.swapaxes(f(jnp.swapaxes(w.values, -1, -2)), -1, -2)
    return Quantized(values, f(w.scales), f(w.offsets) if w.offsets.size else w.offsets)


def join_columns(parts: list) -> jax.Array | Quantized:
    """Weights side by side along their output columns (q|k|v, gate|up), dense or quantized alike."""
    if not isinstance(parts[0], Quantized):
        return jnp.concatenate(parts, axis=-1)
    offsets = parts[0].offsets
    return Quantized(jnp.concatenate([p.values for p in parts], axis=-2),
                     jnp.concatenate([p.scales for p in parts], axis=-1),
                     jnp.concatenate([p.offsets for p in parts], axis=-1) if offsets.size else offsets)


def matmul(x: jax.Array, w: jax.Array | Quantized, *, num_sms: int = 0, dense: bool = False) -> jax.Array:
    """x [T, K] @ w [K, N] in x's dtype, whatever form w is held in. `num_sms` > 0 (a GPU's, set by
    the runner with the Pallas kernels): the calls the Mosaic kernel supports run it (int8 without
    offsets in groups of 64 rows or more, fp8, int4; with `dense`, bf16 weights' decode-shaped calls
    too), unless the weight is split over devices (XLA's partitioner cannot split a kernel)."""
    if not isinstance(w, Quantized):
        if num_sms and dense and _unsplit() and quantized_matmul.dense_supported(x.shape[0], w):
            return quantized_matmul.dense_matmul(x, w, num_sms=num_sms)
        return x @ w
    if num_sms and _unsplit() and quantized_matmul.supported(x.shape[0], w.values, w.scales, w.offsets.size > 0):
        return quantized_matmul.quantized_matmul(x, w.values, w.scales, w.offsets, num_sms=num_sms)
    # Widened only once its input exists: else XLA widens every layer's weight up front, all of
    # them live at once (a step's temporaries grew by the model's size in float32). fp8 ties the
    # weight to the tokens already scaled to e4m3, which round as they did without the tie.
    if w.values.dtype != jnp.float8_e4m3fn:
        x, w = jax.lax.optimization_barrier((x, w))
        return x @ dequantize(w, x.dtype)
    xq, x_scales = quantized_matmul.fp8_rows(x)
    xq, x_scales, w = jax.lax.optimization_barrier((xq, x_scales, w))
    # Precision stated: an fp32 model's "highest" (`step.matmul_precision`) means nothing for e4m3 operands.
    out = jax.lax.dot_general(xq, w.values, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                              precision=jax.lax.Precision.DEFAULT)
    return (out * x_scales * w.scales[0]).astype(x.dtype)


def _unsplit() -> bool:
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.empty or mesh.size == 1
