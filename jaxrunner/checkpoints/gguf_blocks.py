"""llama.cpp's 4-bit blocks as they are: 4-bit values with a scale and an offset per 32 weights.

Every 4-bit type holds a row in runs of 32 weights w = scale * q + offset, q in 0..15, which is the
"int4" format of `models.quantization`; so a GGUF file's Q4_0, Q4_1 and Q4_K weights load into it
without being widened on the way, and dequantize to exactly the floats `gguf.quants.dequantize`
gives (each product and sum is the one it computes). The byte layouts (ggml-common.h):

- Q4_0, 18 bytes per 32 weights: a float16 scale d, then 16 bytes; byte j holds q_j in its low
  nibble and q_(j+16) in its high one; w = d (q - 8).
- Q4_1, 20 bytes per 32: float16 d and m, then the 16 bytes as Q4_0's; w = d q + m.
- Q4_K, 144 bytes per 256: float16 d and dmin, 12 bytes of eight 6-bit scales s_i and minimums
  m_i, then 128 bytes; each run of 32 bytes holds two sub-blocks of 32, the first in the low
  nibbles; sub-block i has w = (d s_i) q - (dmin m_i).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q

INT4_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q4_K)
GROUP = 32


def unpack_int4(data: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of 4-bit blocks (uint8 [rows, bytes]) as (q uint8 [rows, cols], scale and offset
    float32 [rows, cols / 32])."""
    rows = data.shape[0]
    if qtype == Q.Q4_K:
        blocks = data.reshape(rows, -1, 144)
        d, dmin = (blocks[..., i : i + 2].copy().view(np.float16)[..., 0].astype(np.float32) for i in (0, 2))
        s, m = _scales_and_mins(blocks[..., 4:16])
        nibbles = _nibbles(blocks[..., 16:].reshape(rows, -1, 4, 32))  # [rows, superblocks, 4, 2, 32]
        scale, offset = d[..., None] * s, -(dmin[..., None] * m)
    else:
        blocks = data.reshape(rows, -1, 18 if qtype == Q.Q4_0 else 20)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        nibbles = _nibbles(blocks[..., -16:][..., None, :])  # [rows, blocks, 1, 2, 16]
        scale = d
        offset = -8 * d if qtype == Q.Q4_0 else blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    return nibbles.reshape(rows, -1), scale.reshape(rows, -1), offset.reshape(rows, -1)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[..., n] bytes as [..., 2, n]: the low nibbles, then the high ones."""
    return np.stack([packed & 0x0F, packed >> 4], axis=-2)


def _scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes [..., 12] as eight 6-bit scales and eight 6-bit minimums, float32 [..., 8]:
    the first four of each in bytes 0-3 and 4-7 (low 6 bits), the last four from bytes 8-11 (low
    nibble: scale, high nibble: minimum) with their top 2 bits in the top bits of bytes 0-3 and 4-7."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
    mins = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)
