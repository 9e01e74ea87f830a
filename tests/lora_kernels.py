"""The LoRA delta of one projection for a batch whose tokens each name an adapter slot, as two
Pallas (Triton) kernels: shrink, then expand (the split of Punica's SGMV).

The adapters are laid out as `jaxrunner.lora.slots` holds them: `a` [in, L * P * R] (slot l's
part p in columns (l * P + p) * R ...) and `b` [L * P * R, out], block diagonal (part p's R rows
feed only part p's output columns). XLA's dense form multiplies every token by every slot's
columns and zeroes the others; these kernels touch, per block of tokens, only the slots that occur
in it, and per output tile only the R rows of B that feed it:

- shrink, grid (token blocks, parts): for each slot present, x @ A[slot, part]; each token keeps its
  own slot's product. Out: [P, T, R], the token's shrunk activations per part.
- expand, grid (token blocks, output tiles): the tile's part p is fixed by its columns; for each
  slot present, tokens of that slot @ B[slot, part, tile]. Out: the delta [T, out].

On the H200 both are slower than XLA's dense form (docs/benchmarks.md, `benchmarks/lora.py`'s
`pallas` form), so the runner does not call them; they are the measured alternative.

Triton wants power-of-two blocks, so R must be a power of two >= 16 (`dot` needs K >= 16), the
input width and the parts' widths multiples of 16; `supported` says whether a
projection qualifies.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.common import cdiv

NUM_WARPS = 4


def _largest_pow2_divisor(n: int, cap: int) -> int:
    return math.gcd(n, cap)  # cap is a power of two


def supported(in_width: int, part_widths: tuple[int, ...], rank: int) -> bool:
    """Whether the kernels can run a projection of these widths at this padded rank."""
    return (rank >= 16 and rank & (rank - 1) == 0 and in_width % 16 == 0
            and all(w % 16 == 0 for w in part_widths))


def lora_delta_reference(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array, num_slots: int) -> jax.Array:
    """The dense form: every slot's shrink, other slots' columns zeroed, one expand."""
    t = x.shape[0]
    mask = (slots[:, None] == jnp.arange(1, num_slots + 1)[None, :]).astype(x.dtype)
    shrunk = (x @ a).reshape(t, num_slots, -1) * mask[:, :, None]
    return shrunk.reshape(t, -1) @ b


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array, *, num_slots: int,
               part_widths: tuple[int, ...], interpret: bool = False) -> jax.Array:
    """[T, out] delta for x [T, in] whose token t runs slot value slots[t] (0: none; l + 1: slot l)."""
    t, in_width = x.shape
    parts = len(part_widths)
    rank = a.shape[1] // (num_slots * parts)
    if not supported(in_width, part_widths, rank) or b.shape != (a.shape[1], sum(part_widths)):
        raise ValueError(f"LoRA kernels cannot run x {x.shape}, a {a.shape}, b {b.shape} with parts "
                         f"{part_widths}: they need a power-of-two rank >= 16, widths in multiples of 16")
    block_t = 16 if t <= 512 else 64
    padded = cdiv(t, block_t) * block_t
    if padded != t:
        x = jnp.pad(x, ((0, padded - t), (0, 0)))
        slots = jnp.pad(slots, (0, padded - t))
    slots = slots.astype(jnp.int32)
    common = dict(num_slots=num_slots, parts=parts, rank=rank, block_t=block_t)
    block_k = _largest_pow2_divisor(in_width, 512)
    shrunk = pl.pallas_call(
        functools.partial(_shrink_kernel, block_k=block_k, **common),
        grid=(padded // block_t, parts),
        in_specs=[pl.BlockSpec((block_t,), lambda i, p: (i,)), pl.BlockSpec(),
                  pl.BlockSpec()],
        out_specs=pl.BlockSpec((1, block_t, rank), lambda i, p: (p, i, 0)),
        out_shape=jax.ShapeDtypeStruct((parts, padded, rank), x.dtype),
        compiler_params=plt.CompilerParams(num_warps=NUM_WARPS, num_stages=2),
        interpret=interpret,
        name="lora_shrink",
    )(slots, x, a)
    block_n = _largest_pow2_divisor(math.gcd(*part_widths), 256)
    starts = tuple(int(s) for s in np.cumsum((0,) + part_widths)[1:-1])
    delta = pl.pallas_call(
        functools.partial(_expand_kernel, starts=starts, block_n=block_n, **common),
        grid=(padded // block_t, sum(part_widths) // block_n),
        in_specs=[pl.BlockSpec((block_t,), lambda i, j: (i,)), pl.BlockSpec(),
                  pl.BlockSpec()],
        out_specs=pl.BlockSpec((block_t, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((padded, sum(part_widths)), x.dtype),
        compiler_params=plt.CompilerParams(num_warps=NUM_WARPS, num_stages=2),
        interpret=interpret,
        name="lora_expand",
    )(slots, shrunk, b)
    return delta[:t]


def _occurs(slots: jax.Array, slot: int) -> jax.Array:
    # A sum, not jnp.any: Triton's lowering has no reduce_or.
    return jnp.sum((slots == slot + 1).astype(jnp.int32)) > 0


def _shrink_kernel(slots_ref, x_ref, a_ref, out_ref, *, num_slots, parts, rank, block_t, block_k):
    rows = pl.ds(pl.multiple_of(pl.program_id(0) * block_t, block_t), block_t)
    part = pl.program_id(1)
    slots = slots_ref[...]
    out_ref[0] = jnp.zeros((block_t, rank), out_ref.dtype)
    for slot in range(num_slots):
        col = pl.multiple_of((slot * parts + part) * rank, rank)

        @pl.when(_occurs(slots, slot))
        def _(slot=slot, col=col):
            def chunk(k, acc):
                ks = pl.ds(pl.multiple_of(k * block_k, block_k), block_k)
                return acc + jnp.dot(x_ref[rows, ks], a_ref[ks, pl.ds(col, rank)], preferred_element_type=jnp.float32)

            acc = jax.lax.fori_loop(0, x_ref.shape[1] // block_k, chunk, jnp.zeros((block_t, rank), jnp.float32))
            mine = (slots == slot + 1)[:, None]
            out_ref[0] = jnp.where(mine, acc.astype(out_ref.dtype), out_ref[0])


def _expand_kernel(slots_ref, s_ref, b_ref, out_ref, *, num_slots, parts, rank, block_t, starts, block_n):
    rows = pl.ds(pl.multiple_of(pl.program_id(0) * block_t, block_t), block_t)
    col0 = pl.program_id(1) * block_n
    part = jnp.int32(0)
    for start in starts:
        part = part + (col0 >= start).astype(jnp.int32)
    cols = pl.ds(pl.multiple_of(col0, block_n), block_n)
    slots = slots_ref[...]
    shrunk = s_ref[part, rows, :]
    out_ref[...] = jnp.zeros((block_t, block_n), out_ref.dtype)
    for slot in range(num_slots):
        mine = (slots == slot + 1)[:, None]

        @pl.when(_occurs(slots, slot))
        def _(slot=slot, mine=mine):
            row = pl.multiple_of((slot * parts + part) * rank, rank)
            mixed = jnp.dot(jnp.where(mine, shrunk, 0).astype(b_ref.dtype), b_ref[pl.ds(row, rank), cols],
                            preferred_element_type=jnp.float32)
            out_ref[...] += mixed.astype(out_ref.dtype)
