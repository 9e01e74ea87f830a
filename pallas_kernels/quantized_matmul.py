"""Decode-shaped matmuls over quantized weights (and bf16 ones), as a Mosaic GPU (Hopper) kernel.

A decode step multiplies a few token rows by every weight once, so its matmuls are bound by the
bytes of the weights, and XLA reads a quantized weight far below the copy bandwidth: it widens the
whole weight to bf16 in memory before its dot (int8), or runs cuBLAS's fp8 dot at shapes it is not
tuned for (docs/benchmarks.md). Here each program streams one tile of 64 weight rows (output
columns) through shared memory with TMA, several steps in flight, and feeds the tensor cores with
the tokens as the narrow side of the product: out^T [N, M] = W [N, K] @ x^T [K, M], so M (the token
bucket, 8 to 64 rows) is the wgmma's N dimension and no tile is padded to 64 tokens.

- fp8 (e4m3 weights, one scale per output column): the tokens are scaled to e4m3 per row first and
  both operands go to the tensor cores from shared memory as they are; both scales multiply the
  float32 result.
- int8 (groups of `group` along K, a scale per group and output column): a step is one group; its
  tile is loaded to registers, widened to bf16 and multiplied by the group's scales there, then
  multiplied with the tokens' bf16 tile.
- bf16 (`dense_matmul`, the weight [K, N] as the layers hold it): both operands go to the tensor
  cores from shared memory, the weight's tile read transposed. XLA's decode matmuls stream the
  narrower projections below the copy bandwidth (docs/benchmarks.md); this form is there to be
  measured against them per shape (`benchmarks/matmul.py --mosaic`).
- grouped bf16 (`grouped_dense_matmul`, `ragged_dot`'s function over experts [E, K, N]): the same
  program per tile of one expert's rows, for an MoE decode (`kernels="mosaic"`).

A quantized weight is held K-major ([N, K], as Hugging Face stores a linear weight and as the tensor
cores read an fp8 operand); scales are [G, N]. K is cut into `splits` ranges so that narrow layers still
occupy every SM; each range writes float32 partial sums, added by XLA in the epilogue (with the
scales and the transpose back to [M, N], fused into one pass over the small output).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import dtypes
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import cdiv, next_pow2, plan_tiles, tile_major_rows

TILE_N = 64  # weight rows per program: a warpgroup's wgmma M
STAGES = 4  # pipeline steps in flight per program
MAX_ROWS = 64  # token rows the kernel takes; more go to XLA (compute, not bytes, bounds them there)
FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)
INT4_GROUP = 32  # K rows per int4 scale and offset (llama.cpp's 4-bit blocks)
HALF = INT4_GROUP // 2  # the bytes of a group's row, and the K rows of each nibble's wgmma
BF16_128 = 0x4300  # 128.0's bf16 bits: OR-ed with a nibble n, 128 + n exactly, one OR where a conversion takes several


def supported(num_rows: int, values: jax.Array, scales: jax.Array, offsets: bool = False) -> bool:
    """Whether the kernel takes x [num_rows, K] @ values [N, K] (int8 in groups, fp8 per column, or
    uint4 in groups of INT4_GROUP with `offsets`)."""
    n, k = values.shape
    groups = scales.shape[0]
    if values.dtype == jnp.float8_e4m3fn:
        step_ok = groups == 1 and k % 64 == 0 and not offsets
    elif values.dtype == jnp.uint4:
        step_ok = k // groups == INT4_GROUP and k % 64 == 0 and offsets
    else:
        step_ok = values.dtype == jnp.int8 and (k // groups) in (64, 128, 256) and not offsets
    return 8 <= num_rows <= MAX_ROWS and num_rows % 8 == 0 and n % TILE_N == 0 and step_ok


@dataclasses.dataclass(frozen=True)
class Tiling:
    """How a call cuts its work, for measuring other cuts (`benchmarks/matmul.py --sweep`): K per
    pipeline step (0: the format's), steps in flight, K ranges (0: `split_count`'s) and weight rows
    per program (a multiple of a wgmma's 64)."""
    step: int = 0
    stages: int = STAGES
    splits: int = 0
    rows: int = TILE_N


def split_count(n: int, steps: int, num_sms: int, rows: int = TILE_N, stages: int = STAGES) -> int:
    """K ranges: the fewest (a power of two, at least 2) that give two programs per SM, each range
    keeping a full pipeline's steps."""
    splits = 2
    while (n // rows) * splits < 2 * num_sms and steps % (2 * splits) == 0 and steps // (2 * splits) >= stages:
        splits *= 2
    return splits if steps % splits == 0 and steps // splits >= 1 else 1


def quantized_matmul(x: jax.Array, values: jax.Array, scales: jax.Array, offsets: jax.Array | None = None, *,
                     num_sms: int, interpret: bool = False, tiling: Tiling = Tiling()) -> jax.Array:
    """x [M, K] @ (values [N, K] scaled by scales [G, N], plus offsets [G, N] for uint4)^T in x's
    dtype, [M, N]. `interpret`: simulated on the CPU, fp8 only (Mosaic GPU's interpreter has no
    register operand for wgmma, which the integer formats' widened tiles are)."""
    if interpret and values.dtype != jnp.float8_e4m3fn:
        raise ValueError("quantized_matmul interprets fp8 weights only: the integer formats' widened tiles are a "
                         "register operand, which Mosaic GPU's interpreter cannot run")
    if not supported(x.shape[0], values, scales, offsets is not None and offsets.size > 0):
        raise ValueError(f"quantized_matmul cannot run x {x.shape} by {values.dtype} {values.shape} with "
                         f"{scales.shape[0]} scale groups: see `supported`")
    if values.dtype == jnp.float8_e4m3fn:
        xq, x_scales = fp8_rows(x)
        step = tiling.step or (128 if values.shape[1] % 128 == 0 else 64)  # one swizzled row of 128 bytes or 64
        partial = _partial_sums(xq, values, scales, step, num_sms, interpret, tiling)
        return (partial.sum(0).T * x_scales * scales[0]).astype(x.dtype)
    if values.dtype == jnp.uint4:
        step = tiling.step or (256 if values.shape[1] % 256 == 0 else 128 if values.shape[1] % 128 == 0 else 64)
        packed, xp = int4_operands(values, x.astype(jnp.bfloat16))
        return _partial_sums(xp, packed, scales, step, num_sms, interpret, tiling, offsets=offsets).sum(0).T.astype(x.dtype)
    step = values.shape[1] // scales.shape[0]  # one scale group
    return _partial_sums(x.astype(jnp.bfloat16), values, scales, step, num_sms, interpret, tiling).sum(0).T.astype(x.dtype)


def int4_operands(values: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(uint4 `values` [N, K] as the bytes that hold them, [N, K / 2]; x [M, K] reordered to match).
    Byte j of a group's row holds K row 2j in its low nibble and 2j + 1 in its high one, so the
    kernel's low nibbles are a group's even rows and its high ones the odd rows: x's columns go in
    that order, each group's even columns, then its odd ones, and each nibble multiplies 16
    contiguous columns."""
    n, k = values.shape
    packed = lax.bitcast_convert_type(values.reshape(n, k // 2, 2), jnp.uint8)
    m = x.shape[0]
    return packed, x.reshape(m, k // INT4_GROUP, HALF, 2).swapaxes(-1, -2).reshape(m, k)


def dense_supported(num_rows: int, w: jax.Array) -> bool:
    """Whether `dense_matmul` takes x [num_rows, K] @ w [K, N]."""
    k, n = w.shape
    return (w.dtype == jnp.bfloat16 and 8 <= num_rows <= MAX_ROWS and num_rows % 8 == 0 and n % TILE_N == 0
            and k % 64 == 0)


def dense_matmul(x: jax.Array, w: jax.Array, *, num_sms: int, interpret: bool = False,
                 tiling: Tiling = Tiling()) -> jax.Array:
    """x [M, K] @ w [K, N] for bf16 w, in x's dtype (`interpret`: simulated on the CPU)."""
    if not dense_supported(x.shape[0], w):
        raise ValueError(f"dense_matmul cannot run x {x.shape} by {w.dtype} {w.shape}: see `dense_supported`")
    step = tiling.step or (128 if w.shape[0] % 128 == 0 else 64)
    return _partial_sums(x.astype(jnp.bfloat16), w, None, step, num_sms, interpret, tiling).sum(0).T.astype(x.dtype)


def grouped_tile(num_rows: int, num_groups: int) -> int:
    """Rows per tile of `grouped_dense_matmul`: about a group's share of the rows, a power of two
    from 8 (a wgmma's narrowest N)."""
    return max(8, next_pow2(cdiv(num_rows, num_groups)))


def grouped_supported(num_rows: int, rhs: jax.Array) -> bool:
    """Whether `grouped_dense_matmul` takes lhs [num_rows, K] by rhs [E, K, N]: bf16, and few
    enough rows per group for a decode's tiles (more are a prefill's, bound by compute)."""
    num_groups, k, n = rhs.shape
    return (rhs.dtype == jnp.bfloat16 and n % TILE_N == 0 and k % 64 == 0
            and grouped_tile(num_rows, num_groups) <= MAX_ROWS)


def grouped_dense_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, num_sms: int,
                         interpret: bool = False) -> jax.Array:
    """`jax.lax.ragged_dot(lhs [M, K], rhs [E, K, N], group_sizes [E])` in lhs's dtype for bf16
    experts (`interpret`: simulated on the CPU). Each tile of a group's rows (`grouped_tile` rows,
    planned as the Triton grouped matmul plans them) streams its expert's weight once, the rows
    the narrow side of the product as in `dense_matmul`: an MoE decode's few rows per expert. A
    TMA copy of rows starts at a multiple of the shared-memory tiling and a group's rows start
    anywhere, so XLA lays the rows out tile by tile first (a tile past its group's end repeats its
    last row), and each row's product is gathered back from its tile (a row past every group comes
    out zero)."""
    num_rows, k = lhs.shape
    if not grouped_supported(num_rows, rhs):
        raise ValueError(f"grouped_dense_matmul cannot run lhs {lhs.shape} by {rhs.dtype} {rhs.shape}: "
                         "see `grouped_supported`")
    tile = grouped_tile(num_rows, rhs.shape[0])
    plan = plan_tiles(group_sizes, num_rows, tile)
    sources = jnp.minimum(plan[:, 1:2] + jnp.arange(tile, dtype=jnp.int32), plan[:, 2:3] - 1).reshape(-1)
    x = lhs.astype(jnp.bfloat16)[jnp.clip(sources, 0, num_rows - 1)]
    step = 128 if k % 128 == 0 else 64
    partial = _partial_sums(x, rhs, None, step, num_sms, interpret, Tiling(), plan=plan, tile=tile)
    by_tile = partial.sum(0).transpose(0, 2, 1).reshape(-1, rhs.shape[2])
    place, valid = tile_major_rows(group_sizes, num_rows, tile)
    return jnp.where(valid[:, None], by_tile[place], 0).astype(lhs.dtype)


def fp8_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(x [M, K] in e4m3, float32 scales [M, 1]): each row scaled so its absolute maximum is e4m3's
    largest value (W8A8's activations, scaled per token as the matmul runs)."""
    xf = x.astype(jnp.float32)
    scales = jnp.max(jnp.abs(xf), axis=-1, keepdims=True) / FP8_MAX
    scales = jnp.where(scales > 0, scales, 1.0)
    return (xf / scales).astype(jnp.float8_e4m3fn), scales


def _transforms(cols: int, dtype) -> tuple:
    """Shared-memory tiling and swizzle for rows of `cols` elements, as TMA writes and wgmma reads them."""
    bits = dtypes.itemsize_bits(dtype)
    swizzle = plgpu.find_swizzle(cols * bits, "quantized_matmul")
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


def _partial_sums(x: jax.Array, values: jax.Array, scales: jax.Array | None, step: int, num_sms: int,
                  interpret: bool, tiling: Tiling, plan: jax.Array | None = None, tile: int = 0,
                  offsets: jax.Array | None = None) -> jax.Array:
    """float32 [splits, N, M]: each K range's W @ x^T, int8 tiles scaled per group as they widen.
    With `offsets`, `values` holds uint4 as bytes ([N, K / 2], `int4_operands`) and x is reordered
    to match; a step's groups each widen to two tiles of 16 K rows (the nibbles), scaled and offset,
    each its own wgmma. Without `scales`, `values` is a bf16 weight [K, N], its tiles read transposed. With `plan`
    (`common.plan_tiles`, tiles of `tile` rows), `values` holds a group's weight [K, N] each
    ([E, K, N]), x holds the tiles' rows tile by tile, and the result is [splits, tiles, N, tile],
    each tile's product by its group's weight (an unused tile's left unwritten)."""
    grouped = plan is not None
    m = tile if grouped else x.shape[0]
    k = x.shape[1]
    dense = scales is None
    n = values.shape[-1] if dense else values.shape[0]
    tiles = plan.shape[0] if grouped else 1
    steps = k // step
    tile_n = tiling.rows
    splits = tiling.splits or split_count(n * tiles, steps, num_sms, tile_n, tiling.stages)
    if k % step or steps % splits or n % tile_n or tile_n % TILE_N:
        raise ValueError(f"{tiling} does not cut K={k} in steps of {step} over {splits} K ranges, or N={n} in tiles "
                         f"of {tile_n} rows (a multiple of {TILE_N}): choose cuts that divide them")
    per_split = steps // splits
    widen = values.dtype != x.dtype  # int8: to bf16 in registers; fp8 goes to the tensor cores as it is
    nibbles = offsets is not None
    groups = step // INT4_GROUP if nibbles else 1  # scale groups per step

    def kernel(*refs, out_smem):
        plan_gmem, x_gmem, v_gmem, *rest = refs if grouped else (None, *refs)
        *s_gmem, out_gmem = rest  # the scales (and offsets), but for a bf16 weight
        rows = pl.ds(lax.axis_index("n") * tile_n, tile_n)
        split = lax.axis_index("split")
        cols = pl.ds(split * per_split * step, per_split * step)
        tokens, out_gmem = pl.ds(0, m), out_gmem.at[split]
        if grouped:
            index = lax.axis_index("tile")
            group = plan_gmem[index, 0]
            tokens = pl.ds(pl.multiple_of(index * m, m), m)
            v_gmem, out_gmem = v_gmem.at[jnp.maximum(group, 0)], out_gmem.at[index]

        def product():
            @functools.partial(pl.run_scoped, acc=plgpu.ACC((tile_n, m), jnp.float32))
            def _(acc):
                def body(_, v_smem, x_smem, *s_smem):
                    if nibbles:
                        for g in range(groups):
                            q = v_smem[:, pl.ds(g * HALF, HALF)].astype(jnp.int16)  # Mosaic GPU shifts no 8-bit type
                            scale, offset = (r[g].astype(jnp.bfloat16)[:, None] for r in s_smem)
                            for half, nibble in enumerate((q & 15, q >> 4)):
                                w = (lax.bitcast_convert_type(nibble | BF16_128, jnp.bfloat16) - 128) * scale + offset
                                plgpu.wgmma(acc, w, x_smem.at[:, pl.ds(g * INT4_GROUP + half * HALF, HALF)].T)
                        plgpu.wgmma_wait(0)
                        return
                    w = v_smem.T if dense else v_smem
                    if widen:
                        w = v_smem[...].astype(jnp.bfloat16) * s_smem[0][0].astype(jnp.bfloat16)[:, None]
                    plgpu.wgmma(acc, w, x_smem.T)
                    plgpu.wgmma_wait(0)

                if dense:
                    weight = plgpu.BlockSpec((step, tile_n), lambda j: (j, 0),
                                             transforms=_transforms(tile_n, values.dtype))
                    refs = [v_gmem.at[cols, rows], x_gmem.at[tokens, cols]]
                elif nibbles:  # a group's 16 bytes a tile, and its nibbles' 16 columns of x
                    weight = plgpu.BlockSpec((tile_n, step // 2), lambda j: (0, j),
                                             transforms=(plgpu.TilingTransform((8, HALF)),))
                    refs = [v_gmem.at[rows, pl.ds(split * (per_split * step // 2), per_split * step // 2)],
                            x_gmem.at[tokens, cols]]
                else:
                    weight = plgpu.BlockSpec((tile_n, step), lambda j: (0, j), transforms=_transforms(step, values.dtype))
                    refs = [v_gmem.at[rows, cols], x_gmem.at[tokens, cols]]
                x_cols = HALF if nibbles else step
                specs = [weight, plgpu.BlockSpec((m, step), lambda j: (0, j), transforms=_transforms(x_cols, x.dtype))]
                if widen:
                    for ref in s_gmem:
                        specs.append(plgpu.BlockSpec((groups, tile_n), lambda j: (j, 0)))
                        refs.append(ref.at[pl.ds(split * per_split * groups, per_split * groups), rows])
                plgpu.emit_pipeline(body, grid=(per_split,), in_specs=specs,
                                    max_concurrent_steps=min(tiling.stages, per_split))(*refs)
                out_smem[...] = acc[...]

            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[rows])
            plgpu.wait_smem_to_gmem(0)

        if grouped:
            pl.when(group >= 0)(product)
        else:
            product()

    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((splits, *((tiles,) if grouped else ()), n, m), jnp.float32),
        grid=(n // tile_n, splits, *((tiles,) if grouped else ())),
        grid_names=("n", "split", *(("tile",) if grouped else ())),
        scratch_types=dict(out_smem=plgpu.SMEM((tile_n, m), jnp.float32)),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(*(() if plan is None else (plan,)), x, values, *([] if dense else [scales]), *([offsets] if nibbles else []))
