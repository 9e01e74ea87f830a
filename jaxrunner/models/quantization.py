"""Quantized weights: a linear weight held in fewer bits, and the matmul that reads it.

Formats (vLLM's `quantization=` names):
- "int8": weight-only (w8a16). Symmetric int8 in groups of up to 128 rows along the input axis K,
  each group with a scale per output column.
- "int4": weight-only (w4a16). Asymmetric: uint4 in groups of 32 rows, each group with a scale and
  an offset per output column (w = scale * q + offset). That is llama.cpp's Q4_0, Q4_1 and Q4_K
  blocks (32 weights, a scale and a minimum), so a GGUF file's 4-bit weights convert without loss;
  groups of 64 lost a third in perplexity on SmolLM2's Q4_1 weights, where 32 lost nothing
  (docs/benchmarks.md).
- "fp8": W8A8 for Hopper's fp8 tensor cores. e4m3 weights with one scale per output column;
  activations are scaled per token as the matmul runs (their absolute maximum over K maps to e4m3's
  largest value), the dot runs in fp8 accumulating in float32, and both scales multiply its result.
The activations stay in the runner's dtype for the weight-only formats: their matmul widens the
weight to it. Scales and offsets are float32, a small part of the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxrunner.config import quantization_group
from jaxrunner.pytree import pytree_dataclass

FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)


@pytree_dataclass
class Quantized:
    """A quantized weight [..., K, N]: `values` in the format's dtype, `scales` float32 [..., G, N]
    (G = K / group size; 1 for fp8), `offsets` float32 like `scales` for int4 ([0] for the
    symmetric formats)."""

    values: jax.Array
    scales: jax.Array
    offsets: jax.Array


def storage_dtype(fmt: str) -> jnp.dtype:
    return jnp.dtype({"fp8": jnp.float8_e4m3fn, "int8": jnp.int8, "int4": jnp.uint4}[fmt])


@dataclass(frozen=True)
class QuantizedStorage:
    """How a quantized weight is held (`models.tensors.Tensor.storage`): the counterpart of `Dense`
    with the same methods: the arrays it holds, their PartitionSpecs, and how it quantizes."""

    format: str

    def struct(self, shape: tuple[int, ...], dtype: str,
               sharding: jax.sharding.Sharding | None = None) -> Quantized:
        scales = (*shape[:-2], shape[-2] // quantization_group(shape[-2], self.format), shape[-1])
        offsets = scales if self.format == "int4" else (0,)
        return Quantized(jax.ShapeDtypeStruct(shape, storage_dtype(self.format), sharding=sharding),
                         jax.ShapeDtypeStruct(scales, jnp.float32, sharding=sharding),
                         jax.ShapeDtypeStruct(offsets, jnp.float32, sharding=sharding if offsets != (0,) else None))

    def store(self, values: jax.Array | np.ndarray, dtype: str) -> Quantized:
        """`values` [..., K, N] quantized (from float32, so a bf16 checkpoint loses nothing more)."""
        return quantize(jnp.asarray(values, jnp.float32), self.format)

    def spec(self, spec: P, shape: tuple[int, ...]) -> Quantized:
        """The arrays split like the weight, the scales' groups with K; one group (fp8's, or int8's
        on a small K) cannot split, so every shard of a weight split along K holds it whole."""
        one_group = len(spec) >= 2 and quantization_group(shape[-2], self.format) == shape[-2]
        scales = P(*spec[:-2], None, spec[-1]) if one_group else spec
        return Quantized(spec, scales, scales if self.format == "int4" else P())


def quantize(w: jax.Array, fmt: str) -> Quantized:
    """Float `w` [..., K, N] in groups of `quantization_group(K)` rows: symmetric (fp8, int8), or from each
    group's minimum in 15 steps to its maximum (int4)."""
    *lead, k, n = w.shape
    g = quantization_group(k, fmt)
    grouped = w.reshape(*lead, k // g, g, n)
    if fmt == "int4":
        low, high = jnp.min(grouped, axis=-2), jnp.max(grouped, axis=-2)
        offsets, steps = low, (high - low) / 15
    else:
        offsets, steps = jnp.zeros((0,)), jnp.max(jnp.abs(grouped), axis=-2) / (FP8_MAX if fmt == "fp8" else 127.0)
    scales = jnp.where(steps > 0, steps, 1.0)  # a constant group: any scale holds it
    scaled = (grouped - (offsets[..., None, :] if fmt == "int4" else 0.0)) / scales[..., None, :]
    if fmt != "fp8":
        scaled = jnp.round(scaled)
    values = scaled.astype(storage_dtype(fmt)).reshape(w.shape)
    return Quantized(values, scales.astype(jnp.float32), offsets.astype(jnp.float32))


def dequantize(w: Quantized, dtype) -> jax.Array:
    """The weight in `dtype` [..., K, N]."""
    *lead, k, n = w.values.shape
    groups = w.scales.shape[-2]
    grouped = w.values.astype(jnp.float32).reshape(*lead, groups, k // groups, n) * w.scales[..., None, :]
    if w.offsets.size:
        grouped = grouped + w.offsets[..., None, :]
    return grouped.reshape(w.values.shape).astype(dtype)


def matmul(x: jax.Array, w: jax.Array | Quantized) -> jax.Array:
    """x [T, K] @ w [K, N] in x's dtype, whatever form w is held in."""
    if not isinstance(w, Quantized):
        return x @ w
    if w.values.dtype != jnp.float8_e4m3fn:
        return x @ dequantize(w, x.dtype)
    xf = x.astype(jnp.float32)
    x_scales = jnp.max(jnp.abs(xf), axis=-1, keepdims=True) / FP8_MAX
    x_scales = jnp.where(x_scales > 0, x_scales, 1.0)
    xq = (xf / x_scales).astype(jnp.float8_e4m3fn)
    # Precision stated: an fp32 model's "highest" (`step.matmul_precision`) means nothing for e4m3 operands.
    out = jnp.dot(xq, w.values, preferred_element_type=jnp.float32, precision=jax.lax.Precision.DEFAULT)
    return (out * x_scales * w.scales[0]).astype(x.dtype)
