"""llama.cpp's quantized blocks as they are: small integers with a scale, and for some types an
offset, per group of 16 or 32 weights.

That is how `models.quantization` holds int4 (uint4 with offsets, groups of 32) and int8 (groups
of any size, offsets or not), so a GGUF file's quantized weights load into those formats without
being widened on the way, and dequantize to exactly the floats `gguf.quants.dequantize` gives.
The types kept, by their bytes per block (ggml-common.h):

- Q4_0 (18 bytes per 32 weights), Q5_0 (22) and Q8_0 (34): a float16 scale d first; w = d q,
  q in -8..7, -16..15 and -128..127.
- Q4_1 (20 per 32) and Q5_1 (24): float16 d and m first; w = d q + m, q in 0..15 and 0..31.
- Q4_K (144 per 256) and Q5_K (176): float16 d and dmin, then 12 bytes of eight 6-bit scales s_i
  and minimums m_i; sub-block i of 32 has w = (d s_i) q - (dmin m_i), q in 0..15 and 0..31.
- Q6_K (210 per 256): sixteen int8 scales s_i at byte 192, then float16 d; sub-block i of 16 has
  w = (d s_i) q, q in -32..31.

The scales and offsets are read from the blocks; the integers are gguf's own floats divided back
by them (each float is the product of a scale and a small integer, plus the offset, rounded once:
the division lands within far less than half a step of the integer, unless an offset dwarfs its
scale). Their products and sums are then the ones gguf computes, bit for bit: `unpack` checks it,
and the integers' range, and gives up on a tensor where either fails (tests check every type); the
loader then quantizes that tensor's floats into its weight's form, with a warning.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as Q


@dataclass(frozen=True)
class Kept:
    """How a block type holds its weights."""

    bits: int  # of each integer
    group: int  # weights per scale
    offsets: bool  # w = scale * q + offset, not scale * q
    size: int  # bytes per block


KEEPS_BLOCKS = ("int8", "int4")  # the quantizations a GGUF file converts into with its blocks as they are
KEPT = {Q.Q4_0: Kept(4, 32, False, 18), Q.Q4_1: Kept(4, 32, True, 20), Q.Q4_K: Kept(4, 32, True, 144),
        Q.Q5_0: Kept(5, 32, False, 22), Q.Q5_1: Kept(5, 32, True, 24), Q.Q5_K: Kept(5, 32, True, 176),
        Q.Q6_K: Kept(6, 16, False, 210), Q.Q8_0: Kept(8, 32, False, 34)}


def unpack(data: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
    """Rows of blocks of a type in `KEPT` (uint8 [rows, bytes]) as (q int8 [rows, cols], scale
    float32 [rows, cols / group], offset like scale or None); None where the integers do not give
    back gguf's floats exactly."""
    from gguf.quants import dequantize

    rows, kept = data.shape[0], KEPT[qtype]
    scale, offset = _scales(data.reshape(rows, -1, kept.size), qtype)
    floats = dequantize(data, qtype).reshape(rows, scale.shape[1], kept.group)
    shifted = floats if offset is None else floats - offset[..., None]
    safe = np.where(scale == 0, 1, scale)[..., None]  # a zero scale holds only its offset: any q
    q = np.where(scale[..., None] == 0, 0, np.rint(shifted / safe))
    low, high = (0, 2**kept.bits - 1) if kept.offsets else (-(2 ** (kept.bits - 1)), 2 ** (kept.bits - 1) - 1)
    back = q.astype(np.float32) * scale[..., None]
    back = back if offset is None else back + offset[..., None]
    if q.min() < low or q.max() > high or not np.array_equal(back, floats):
        return None
    return q.astype(np.int8).reshape(rows, -1), scale, offset


def _scales(blocks: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray | None]:
    """Each group's scale and offset (None for a symmetric type), float32 [rows, groups]."""
    rows = blocks.shape[0]
    if qtype == Q.Q6_K:
        d = _float16(blocks[..., 208:210])
        return (d[..., None] * blocks[..., 192:208].view(np.int8).astype(np.float32)).reshape(rows, -1), None
    if qtype in (Q.Q4_K, Q.Q5_K):
        d, dmin = _float16(blocks[..., 0:2]), _float16(blocks[..., 2:4])
        s, m = _scales_and_mins(blocks[..., 4:16])
        return (d[..., None] * s).reshape(rows, -1), (-(dmin[..., None] * m)).reshape(rows, -1)
    d = _float16(blocks[..., 0:2])
    return d, _float16(blocks[..., 2:4]) if KEPT[qtype].offsets else None


def _float16(pair: np.ndarray) -> np.ndarray:
    """[..., 2] bytes as the float16 they hold, widened to float32 [...]."""
    return pair.copy().view(np.float16)[..., 0].astype(np.float32)


def _scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The K types' 12 bytes [..., 12] as eight 6-bit scales and eight 6-bit minimums, float32 [..., 8]:
    the first four of each in bytes 0-3 and 4-7 (low 6 bits), the last four from bytes 8-11 (low
    nibble: scale, high nibble: minimum) with their top 2 bits in the top bits of bytes 0-3 and 4-7."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
    mins = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)
