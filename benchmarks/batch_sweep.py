"""Decode throughput against batch size: output tokens per second of the decode step at each batch
size (every sequence at `--context` tokens), beside the floor's (weights + KV bytes over the copy
bandwidth, or the FLOPs at 790 TFLOP/s). Steps are dispatched as the engine does (async, `--decode-steps`
per call) and timed untraced.

    PYTHONPATH=$PWD python benchmarks/batch_sweep.py --shape llama3-8b --context 1024
Writes $OUT/batch_sweep.json and $OUT/batch_sweep.png (matplotlib) when OUT is set. Runs split
over several device calls merge into one plot with `--merge a.json b.json --png out.png`.
"""

from __future__ import annotations

import argparse
import json
import os

import jax

from benchmarks.profile import decode_batch, floor_ms, pipelined
from jaxrunner.checkpoints.dummy import SHAPES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32, 64, 128, 256])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="plot the rows of earlier runs instead of measuring")
    parser.add_argument("--png", help="with --merge: where to write the plot (the merged JSON goes beside it)")
    args = parser.parse_args()
    if args.merge:
        runs = [json.load(open(path)) for path in args.merge]
        if len({(r["shape"], r["context"], r["device"]) for r in runs}) != 1:
            raise SystemExit("--merge: the runs differ in shape, context or device")
        rows = sorted((row for r in runs for row in r["rows"]), key=lambda row: row["batch"])
        result = runs[0] | {"batches": [row["batch"] for row in rows], "rows": rows}
        with open(os.path.splitext(args.png)[0] + ".json", "w") as f:
            json.dump(result, f, indent=1)
        plot(result, args.png)
        return

    rows = []
    for batch in args.batches:
        runner, state, scheds = decode_batch(args.shape, batch, args.context, args.steps + 2, args.decode_steps)
        state, _ = pipelined(runner, state, scheds[:2])  # compile and warm
        state, seconds = pipelined(runner, state, scheds[2:])
        step_ms = seconds / args.steps / args.decode_steps * 1e3
        floor = floor_ms(runner, batch, args.context)
        rows.append({"batch": batch, "step_ms": step_ms, "tokens_per_s": batch / step_ms * 1e3,
                     "floor_ms": floor, "floor_tokens_per_s": batch / floor * 1e3})
        print(json.dumps(rows[-1]))
        del runner, state
    result = {"device": jax.devices()[0].device_kind, **vars(args), "rows": rows}
    if out := os.environ.get("OUT"):
        with open(os.path.join(out, "batch_sweep.json"), "w") as f:
            json.dump(result, f, indent=1)
        plot(result, os.path.join(out, "batch_sweep.png"))


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = [r["batch"] for r in result["rows"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(batches, [r["tokens_per_s"] for r in result["rows"]], "o-", label="jaxrunner decode step")
    ax.plot(batches, [r["floor_tokens_per_s"] for r in result["rows"]], "--", label="floor (bandwidth / FLOPs)")
    ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="output tokens / s",
           title=f"{result['shape']} decode, {result['context']}-token context, {result['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
