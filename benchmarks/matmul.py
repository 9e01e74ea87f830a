"""Decode-step projections in the model's weight layout against the unfused one, under XLA.

Each case multiplies a 16-row (`--rows`) bf16 activation (the smallest token bucket) by the weights of
`--layers` layers in one jitted call, as a decode step does, so the weights come from HBM, not L2;
its time is the GPU's busy time in a device trace. Prints GB/s of weight bytes read and the
fraction of the H200's copy bandwidth (docs/design.md): the reason q|k|v and gate|up are stored side by side.
With `--quantization` the weights are held in that format (models/quantization.py) and the bytes
counted are the ones it stores, so the figures say how close each format's matmul comes to streaming them;
the matmul is the runner's (`step.projection_matmul`: the Mosaic kernel where it applies), or XLA's
alone with `--xla`. `--batch-invariant` runs the mode's projections (the grouped matmul's fixed
tiles and K ranges, `row_tiles.fixed_tile_matmul`), `--mosaic` bf16 weights through the Mosaic
kernel (`quantized_matmul.dense_matmul`, 8 to 64 rows), and `--rows` sets the activation's rows
(W2's decode: 256). `--sweep` runs the Mosaic kernel of the format (bf16: `dense_matmul`) in other
cuts (`quantized_matmul.Tiling`: K per step, steps in flight, K ranges) and prints each case's
measurement as it goes (the JSON after each case), to choose the kernel's cuts from measurements.

    PYTHONPATH=$PWD python benchmarks/matmul.py --shape llama3-8b [--quantization fp8|int8|int4] [--batch-invariant] [--sweep]
Writes $OUT/matmul_<shape>[_<format>][_invariant][_r<rows>].json when OUT is set.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os

import jax
import jax.numpy as jnp

from benchmarks.profile import busy_ns, trace_kernels
from jaxrunner import platform
from jaxrunner.bench.floors import COPY_BANDWIDTH, weight_bytes_per_step
from jaxrunner.checkpoints.dummy import SHAPES, shape
from jaxrunner.config import QUANTIZATION_FORMATS, Kernels
from jaxrunner.models.quantization import matmul, quantize
from jaxrunner.runner.step import projection_matmul
from pallas_kernels.quantized_matmul import STAGES, Tiling, dense_matmul, quantized_matmul


def layouts(name: str) -> dict[str, list[tuple[int, int]]]:
    """Per case, the [in, out] weights one layer multiplies the same activation by."""
    cfg = shape(name)
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "q, k, v (unfused)": [(h, q), (h, kv), (h, kv)],
        "qkv (ours)": [(h, q + 2 * kv)],
        "o": [(q, h)],
        "gate, up (unfused)": [(h, inter), (h, inter)],
        "gate_up (ours)": [(h, 2 * inter)],
        "down": [(inter, h)],
        "lm_head": [(h, cfg.vocab_size)],
    }


def seconds_per_layer(x: jax.Array, layers: list[list], reps: int, product) -> float:
    """GPU busy time per layer, from a device trace of `reps` calls of `product`."""
    call = jax.jit(lambda x, layers: [[product(x, w) for w in ws] for ws in layers])
    jax.block_until_ready(call(x, layers))
    events = trace_kernels(lambda: [jax.block_until_ready(call(x, layers)) for _ in range(reps)])
    return busy_ns(events) / (reps * len(layers)) / 1e9


def weight(key: jax.Array, shape: tuple[int, int], fmt: str | None):
    w = jax.random.normal(key, shape, jnp.bfloat16)
    return quantize(w, fmt) if fmt else w


def kernel_product(fmt: str | None, tiling: Tiling):
    """The format's Mosaic kernel in `tiling`'s cuts, as a (x, w) -> x @ w."""
    num_sms = platform.num_sms()
    if fmt is None:
        return functools.partial(dense_matmul, num_sms=num_sms, tiling=tiling)
    return lambda x, w: quantized_matmul(x, w.values, w.scales, w.offsets, num_sms=num_sms, tiling=tiling)


OTHER_STEPS = {None: (64, 256), "fp8": (64, 256), "int4": (128, 512), "int8": ()}  # int8's step is its scale group


def tilings(fmt: str | None) -> list[Tiling]:
    """The default cuts first, then each of them changed alone (K per step, steps in flight, K ranges
    with 0 for `split_count`'s, weight rows per program), and a few pairs of those changes."""
    default = Tiling()
    alone = [*(Tiling(step=s) for s in OTHER_STEPS[fmt]), Tiling(stages=2), Tiling(stages=2 * STAGES),
             *(Tiling(splits=n) for n in (1, 4, 8)), Tiling(rows=2 * default.rows)]
    pairs = [Tiling(rows=2 * default.rows, stages=2 * STAGES), Tiling(rows=2 * default.rows, splits=1),
             *(Tiling(step=s, stages=2 * STAGES) for s in OTHER_STEPS[fmt][-1:])]
    return [default, *alone, *pairs]


def sweep(case: str, x: jax.Array, layers: list[list], layer_bytes: float, reps: int, fmt: str | None) -> dict:
    """Seconds per layer for each cut that compiles, runs and agrees with the default cut's product
    (float32 sums in another order: within 1% of its largest value); else why not, by `Tiling`'s
    repr. Each cut is printed as it is measured (a device trace each: seconds apiece)."""
    want = jnp.asarray(kernel_product(fmt, Tiling())(x, layers[0][0]), jnp.float32)
    seconds = {}
    for tiling in tilings(fmt):
        product = kernel_product(fmt, tiling)
        try:
            error = float(jnp.max(jnp.abs(product(x, layers[0][0]).astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))
            t = (seconds_per_layer(x, layers, reps, product) if error < 1e-2
                 else f"wrong: largest error {error:.3g} of the largest value")
        except Exception as e:  # a cut the kernel refuses, or one Mosaic GPU cannot lower
            t = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        seconds[repr(tiling)] = t
        print(f"{case:12s} {tiling!r:40s} " + (f"{t * 1e6:7.1f} us {layer_bytes / t / 1e9:6.0f} GB/s "
              f"({layer_bytes / t / COPY_BANDWIDTH:4.0%} of copy)" if isinstance(t, float) else t), flush=True)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quantization", choices=QUANTIZATION_FORMATS)
    parser.add_argument("--xla", action="store_true", help="XLA's matmul, not the runner's choice")
    parser.add_argument("--batch-invariant", action="store_true", help="the batch-invariant mode's projections")
    parser.add_argument("--mosaic", action="store_true", help="bf16 weights through the Mosaic kernel (dense_matmul)")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--sweep", action="store_true", help="the format's Mosaic kernel in other cuts")
    args = parser.parse_args()
    if jax.default_backend() != "gpu":
        raise SystemExit("benchmarks/matmul.py needs a GPU: its times come from a device trace")

    results = {"device": jax.devices()[0].device_kind, "quantization": args.quantization or "bf16", "xla": args.xla,
               "batch_invariant": args.batch_invariant, "rows": args.rows, "sweep": args.sweep,
               "xla_flags": os.environ.get("XLA_FLAGS", ""), "cases": {}}
    product = matmul if args.xla else projection_matmul(Kernels.choose("auto", batch_invariant=args.batch_invariant))
    if args.mosaic:
        product = functools.partial(dense_matmul, num_sms=platform.num_sms())
    key = itertools.count()
    for case, shapes in layouts(args.shape).items():
        if args.sweep and ("unfused" in case or case == "lm_head"):  # the runner holds fused projections; the head stays bf16
            continue
        k = shapes[0][0]
        count = max(2, min(args.layers, int(4e9 // sum(2 * a * b for a, b in shapes))))
        layers = [[weight(jax.random.key(next(key)), s, args.quantization) for s in shapes] for _ in range(count)]
        layer_bytes = weight_bytes_per_step({"layers": layers}) / count
        x = jax.random.normal(jax.random.key(0), (args.rows, k), jnp.bfloat16)
        if args.sweep:
            results["cases"][case] = {"shapes": shapes, "layer_bytes": layer_bytes,
                                      "seconds": sweep(case, x, layers, layer_bytes, args.reps, args.quantization)}
            del layers
            write(results, args)
            continue
        seconds = seconds_per_layer(x, layers, args.reps, product)
        gbps = layer_bytes / seconds / 1e9
        results["cases"][case] = {"shapes": shapes, "us_per_layer": seconds * 1e6, "gbps": gbps}
        print(f"{case:20s} {' + '.join(f'[{a}x{b}]' for a, b in shapes):32s} {seconds * 1e6:7.1f} us "
              f"{gbps:6.0f} GB/s ({gbps * 1e9 / COPY_BANDWIDTH:4.0%} of copy)", flush=True)
        del layers
    write(results, args)


def write(results: dict, args: argparse.Namespace) -> None:
    """$OUT/matmul_<shape>[_<format>][_xla][_invariant][_mosaic][_sweep][_r<rows>].json, when OUT is set."""
    if os.environ.get("OUT"):
        name = (f"matmul_{args.shape}" + (f"_{args.quantization}" if args.quantization else "") + ("_xla" if args.xla else "")
                + ("_invariant" if args.batch_invariant else "") + ("_mosaic" if args.mosaic else "")
                + ("_sweep" if args.sweep else "") + (f"_r{args.rows}" if args.rows != 16 else ""))
        with open(os.path.join(os.environ["OUT"], f"{name}.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
