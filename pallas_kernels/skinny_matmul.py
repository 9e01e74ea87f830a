"""`x @ w` for the few rows of a decode step: a memory-bound split-K matmul.

At decode a projection multiplies a handful of token rows by a weight of tens to hundreds of MB,
so its time is the time to stream the weight once. The kernel tiles the weight into
`[block_k, block_n]` tiles, gives each program a column block and a `1/splits` share of the rows,
and accumulates on the tensor cores in fp32 (Triton's `dot` wants at least 16 rows: x is padded to
16). Each split writes an fp32 partial; their sum (and the cast) is an elementwise op that XLA fuses
into whatever reads the result.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.common import cdiv

MIN_ROWS = 16  # Triton's dot needs M >= 16


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    block_n: int = 128
    block_k: int = 128
    splits: int = 4
    num_warps: int = 4
    num_stages: int = 4

    def fits(self, k: int, n: int) -> bool:
        """Whether the tiling divides a [k, n] weight exactly (no masking in the kernel)."""
        return n % self.block_n == 0 and k % (self.block_k * self.splits) == 0


def default_config(k: int, n: int) -> MatmulConfig | None:
    """A tiling that divides [k, n] with enough programs to keep every SM streaming, or None."""
    for block_n in (128, 64):
        for splits in (4, 2, 1, 8):
            cfg = MatmulConfig(block_n=block_n, splits=splits)
            if cfg.fits(k, n):
                return cfg
    return None


def skinny_matmul(x: jax.Array, w: jax.Array, *, config: MatmulConfig | None = None,
                  interpret: bool | None = None) -> jax.Array:
    """`x [M, K] @ w [K, N]` in x's dtype, fp32 accumulation. Needs a tiling that divides w's shape
    (`default_config` returns None when none does: use an ordinary matmul then). Runs interpreted
    (slowly) off GPU unless told otherwise."""
    m, k = x.shape
    if w.shape[0] != k:
        raise ValueError(f"skinny_matmul: x {x.shape} and w {w.shape} do not contract")
    cfg = config or default_config(*w.shape)
    if cfg is None or not cfg.fits(*w.shape):
        raise ValueError(f"skinny_matmul: no tiling {cfg} divides the weight {w.shape}")
    rows = max(MIN_ROWS, 1 << (m - 1).bit_length())
    xp = jnp.pad(x, ((0, rows - m), (0, 0))).astype(w.dtype)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    partials = _partials(xp, w, cfg=cfg, interpret=interpret)
    return partials.reshape(cfg.splits, rows, -1).sum(axis=0)[:m].astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def _partials(x: jax.Array, w: jax.Array, *, cfg: MatmulConfig, interpret: bool) -> jax.Array:
    rows, k = x.shape
    n = w.shape[1]
    steps = k // cfg.splits // cfg.block_k

    def kernel(x_ref, w_ref, o_ref):
        col, split = pl.program_id(0), pl.program_id(1)
        cols = pl.ds(pl.multiple_of(col * cfg.block_n, cfg.block_n), cfg.block_n)

        def body(i, acc):
            ks = pl.ds(pl.multiple_of((split * steps + i) * cfg.block_k, cfg.block_k), cfg.block_k)
            return acc + jnp.dot(x_ref[:, ks], w_ref[ks, cols], preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((rows, cfg.block_n), jnp.float32))
        o_ref[pl.ds(split * rows, rows), cols] = acc

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((cfg.splits * rows, n), jnp.float32),
        grid=(cdiv(n, cfg.block_n), cfg.splits),
        compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="skinny_matmul",
    )(x, w)
