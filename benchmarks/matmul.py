"""Decode-step projections: XLA's matmul against the Pallas skinny matmul, per weight shape.

Each case multiplies a 16-row bf16 activation (the smallest token bucket) by `--layers` distinct
weights of one projection's shape in one jitted call, as a decode step does, so the weights come
from HBM, not L2. Prints GB/s of weight bytes read and the fraction of DESIGN.md's copy bandwidth;
`--sweep` times a grid of tilings and reports the best per shape.

    PYTHONPATH=$PWD python benchmarks/matmul.py --shape llama3-8b --sweep
Writes $OUT/matmul_<shape>[_<tag>].json when OUT is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os

import jax
import jax.numpy as jnp

from benchmarks.profile import busy_ns, trace_kernels
from jaxrunner.bench.shapes import COPY_BANDWIDTH, SHAPES, shape
from pallas_kernels.skinny_matmul import MatmulConfig, default_config, skinny_matmul


def projections(name: str) -> dict[str, tuple[int, int]]:
    cfg = shape(name)
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    return {
        "qkv": (h, (cfg.num_heads + 2 * cfg.num_kv_heads) * d),
        "o": (cfg.num_heads * d, h),
        "gate_up": (h, 2 * inter),
        "gate": (h, inter),
        "down": (inter, h),
        "lm_head": (h, cfg.vocab_size),
    }


def seconds_per_matmul(fn, x: jax.Array, ws: list, reps: int) -> tuple[float, float]:
    """GPU busy time per matmul from a device trace of `reps` calls: all kernels, and the Pallas
    kernel alone (its split-K sum is a separate small kernel here; in the model XLA fuses it into
    the consumer)."""
    call = jax.jit(lambda x, ws: [fn(x, w) for w in ws])
    jax.block_until_ready(call(x, ws))
    events = trace_kernels(lambda: [jax.block_until_ready(call(x, ws)) for _ in range(reps)])
    count = reps * len(ws)
    kernel = [e for e in events if "skinny_matmul" in e[0]] or events
    return busy_ns(events) / count / 1e9, busy_ns(kernel) / count / 1e9


def sweep_configs(k: int, n: int) -> list[MatmulConfig]:
    """Tiles of 16-64 KiB and one to eight programs per SM (H200: 132 SMs)."""
    grid = itertools.product((64, 128, 256), (64, 128, 256), (1, 2, 4, 8, 16))
    configs = [MatmulConfig(bn, bk, s, num_warps=8 if bn * bk >= 32768 else 4)
               for bn, bk, s in grid if 8192 <= bn * bk <= 32768 and 132 <= n // bn * s <= 1056]
    return [c for c in configs if c.fits(k, n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--sweep", action="store_true", help="time a grid of tilings, not just the default")
    parser.add_argument("--xla-only", action="store_true", help="time XLA's matmul only (e.g. under other XLA_FLAGS)")
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    if jax.default_backend() != "gpu":
        raise SystemExit("benchmarks/matmul.py needs a GPU: its times come from a device trace")

    x = jax.random.normal(jax.random.key(0), (16, 1), jnp.bfloat16)
    results = {"device": jax.devices()[0].device_kind, "xla_flags": os.environ.get("XLA_FLAGS", ""), "cases": {}}
    for case, (k, n) in projections(args.shape).items():
        count = max(2, min(args.layers, int(4e9 // (k * n * 2))))
        ws = [jax.random.normal(jax.random.key(i), (k, n), jnp.bfloat16) * 0.02 for i in range(count)]
        xk = jnp.tile(x, (1, k))
        gbps = lambda s: k * n * 2 / s / 1e9  # noqa: E731
        row = {"k": k, "n": n, "xla_gbps": gbps(seconds_per_matmul(jnp.matmul, xk, ws, args.reps)[0])}
        configs = [] if args.xla_only else (sweep_configs(k, n) if args.sweep else [default_config(k, n)])
        timed = []
        for cfg in filter(None, configs):
            fn = lambda x, w, cfg=cfg: skinny_matmul(x, w, config=cfg)  # noqa: E731
            total, kernel = seconds_per_matmul(fn, xk, ws, args.reps)
            timed.append((gbps(total), gbps(kernel), cfg))
        if timed:
            best_gbps, kernel_gbps, best = max(timed, key=lambda t: t[0])
            row |= {"pallas_gbps": best_gbps, "pallas_kernel_gbps": kernel_gbps, "pallas_config": dataclasses.asdict(best),
                    "top5": [(round(g), round(kg), str(c)) for g, kg, c in sorted(timed, key=lambda t: -t[0])[:5]]}
        results["cases"][case] = row
        line = f"{case:8s} [{k:6d} x {n:6d}]  xla {row['xla_gbps']:7.0f} GB/s ({row['xla_gbps'] * 1e9 / COPY_BANDWIDTH:4.0%})"
        if timed:
            line += (f"  pallas {best_gbps:7.0f} GB/s ({best_gbps * 1e9 / COPY_BANDWIDTH:4.0%}; kernel alone"
                     f" {kernel_gbps * 1e9 / COPY_BANDWIDTH:4.0%})  {best}")
        print(line, flush=True)
        del ws
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"matmul_{args.shape}{'_' + args.tag if args.tag else ''}.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
