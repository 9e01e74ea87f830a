"""fp8 checkpoints as Hugging Face stores them: each quantized linear weight e4m3 [out, in] beside
its scales, which multiply the stored values: `weight_scale` (compressed-tensors, RedHatAI's
releases: one per output channel [out, 1], or one for the tensor) or `weight_scale_inv` (Qwen's
"fp8": one per block of the config's `weight_block_size`, 128 x 128). Read into the runner's fp8
format (`models.quantization`: values [out, in] as stored, a scale per output column): per channel and per
tensor exactly; blocks, whose scales also vary along the input, widened and rounded again per column.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxrunner.models.quantization import Quantized, quantize


def block_size(path: str) -> tuple[int, int] | None:
    """The checkpoint's `weight_block_size` ([out, in] rows and columns per scale), or None."""
    with open(os.path.join(path, "config.json")) as f:
        block = (json.load(f).get("quantization_config") or {}).get("weight_block_size")
    return None if block is None else (int(block[0]), int(block[1]))


def read_fp8(tensors, name: str, block: tuple[int, int] | None) -> Quantized:
    """The fp8 weight `name` and its scales from `tensors` (`loader.SafetensorsFiles`)."""
    values = tensors.read(name)
    if values.dtype != ml_dtypes.float8_e4m3fn:
        raise ValueError(f"tensor {name} is {values.dtype}, but the checkpoint's quantization_config says fp8 (e4m3)")
    out = values.shape[0]
    if block is None:
        scale = np.asarray(tensors.read(f"{name}_scale"), np.float32).reshape(-1)  # [out] or [1]
        scales = np.broadcast_to(scale, (out,))[None, :]
        return Quantized(jnp.asarray(values), jnp.asarray(scales), jnp.zeros((0,), jnp.float32))
    inv = np.asarray(tensors.read(f"{name}_scale_inv"), np.float32)
    full = np.repeat(np.repeat(inv, block[0], axis=0), block[1], axis=1)[:out, : values.shape[1]]
    return quantize((values.astype(np.float32) * full).T, "fp8")
