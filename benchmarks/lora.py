"""The cost of the LoRA projections of a whole step, in each form the batched adapters could take.

For every layer of `--shape` (W2's Qwen3-0.6B by default) one jitted call runs the four
projections (q|k|v, o, gate|up, down) of a `--tokens`-row bf16 activation, base weights plus
`--loras` adapter slots of rank `--rank`, each token in a random slot (0: none). Forms:
  base         the base projections alone (what a step without LoRA pays)
  masked       every slot's shrink in one matmul, other slots' columns zeroed, then one expand
               matmul per part (q, k, v / gate, up)
  blockdiag    the same shrink, then one expand per projection against a block-diagonal B
  fused        the shrink's A stored beside the base weight (one matmul gives both), then the
               block-diagonal expand
  ragged       tokens sorted by slot, shrink and expand as grouped matmuls (`jax.lax.ragged_dot`)
  pallas       the block-diagonal layout through the Pallas shrink and expand kernels
               (`tests/lora_kernels.py`), which skip the slots a block of tokens does not use
Prints the median wall time per call (a step is one call: launches count) and the extra over base.

    PYTHONPATH=$PWD python3 -P benchmarks/lora.py [--tokens 256] [--loras 4] [--rank 16] [--run-length 1]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrunner.checkpoints.dummy import SHAPES, shape
from jaxrunner.lora.slots import projection_parts

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))  # the Pallas LoRA kernels live beside their test
from lora_kernels import lora_delta  # noqa: E402

FORMS = ("base", "masked", "blockdiag", "fused", "ragged", "pallas")


def make_layer(key: jax.Array, parts: dict, n: int, r: int) -> dict:
    layer = {}
    for i, (name, (width, outs)) in enumerate(parts.items()):
        k = jax.random.split(jax.random.fold_in(key, i), 3 + len(outs))
        out = sum(outs)
        a = 0.02 * jax.random.normal(k[0], (width, n * len(outs) * r))
        bs = [0.02 * jax.random.normal(k[3 + p], (n * r, o)) for p, o in enumerate(outs)]
        bd = jnp.zeros((n * len(outs) * r, out))  # block diagonal: slot l part p's rows feed part p's columns
        col = np.cumsum((0,) + outs)
        for slot in range(n):
            for p in range(len(outs)):
                rows = slice((slot * len(outs) + p) * r, (slot * len(outs) + p + 1) * r)
                bd = bd.at[rows, col[p] : col[p + 1]].set(bs[p][slot * r : (slot + 1) * r])
        w = 0.02 * jax.random.normal(k[1], (width, out))
        layer[name] = {
            "w": w.astype(jnp.bfloat16), "a": a.astype(jnp.bfloat16), "b": tuple(b.astype(jnp.bfloat16) for b in bs),
            "bd": bd.astype(jnp.bfloat16), "wa": jnp.concatenate([w, a], axis=1).astype(jnp.bfloat16),
            # per slot, for ragged_dot: [n, in, P * r] and [n, P * r, out] (block diagonal per slot)
            "ga": a.reshape(width, n, len(outs) * r).transpose(1, 0, 2).astype(jnp.bfloat16),
            "gb": bd.reshape(n, len(outs) * r, out).astype(jnp.bfloat16),
        }
    return layer


def project(form: str, x: jax.Array, p: dict, mask: jax.Array, order: jax.Array, sizes: jax.Array,
            slots: jax.Array) -> jax.Array:
    t, n = x.shape[0], mask.shape[1]
    if form == "base":
        return x @ p["w"]
    if form == "pallas":
        widths = tuple(b.shape[1] for b in p["b"])
        return x @ p["w"] + lora_delta(x, p["a"], p["bd"], slots, num_slots=n, part_widths=widths,
                                          interpret=jax.default_backend() == "cpu")
    if form == "fused":
        out = p["w"].shape[1]
        both = x @ p["wa"]
        shrunk = both[:, out:].reshape(t, n, -1) * mask[:, :, None]
        return both[:, :out] + shrunk.reshape(t, -1) @ p["bd"]
    if form == "ragged":  # sizes[0] tokens without an adapter first, then slot by slot
        xs = x[order]
        shrunk = jax.lax.ragged_dot(xs, jnp.concatenate([jnp.zeros_like(p["ga"][:1]), p["ga"]]), sizes)
        delta = jax.lax.ragged_dot(shrunk, jnp.concatenate([jnp.zeros_like(p["gb"][:1]), p["gb"]]), sizes)
        return x @ p["w"] + jnp.zeros_like(delta).at[order].set(delta)
    parts = len(p["b"])
    shrunk = (x @ p["a"]).reshape(t, n, parts, -1) * mask[:, :, None, None]
    if form == "blockdiag":
        return x @ p["w"] + shrunk.reshape(t, -1) @ p["bd"]
    return x @ p["w"] + jnp.concatenate([shrunk[:, :, q].reshape(t, -1) @ b for q, b in enumerate(p["b"])], axis=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--loras", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--run-length", type=int, default=1,
                        help="tokens in a row that share a slot: 1 as in decode (W2's request i runs adapter i mod 4), "
                             "a chunk's length as in prefill")
    args = parser.parse_args()
    cfg = shape(args.shape)
    parts = projection_parts(cfg)
    key = jax.random.key(0)
    layers = [make_layer(jax.random.fold_in(key, i), parts, args.loras, args.rank) for i in range(cfg.num_layers)]
    results = {"device": jax.devices()[0].device_kind, "shape": args.shape, "loras": args.loras, "rank": args.rank,
               "run_length": args.run_length,
               "layers": cfg.num_layers, "ms_per_step": {}}
    for t in args.tokens:
        rng = np.random.default_rng(t)
        slots = np.repeat(rng.integers(0, args.loras + 1, -(-t // args.run_length)), args.run_length)[:t].astype(np.int32)
        order = np.argsort(slots, kind="stable").astype(np.int32)
        sizes = np.bincount(slots, minlength=args.loras + 1).astype(np.int32)
        mask = jnp.asarray(slots[:, None] == np.arange(1, args.loras + 1)[None, :], jnp.bfloat16)
        xs = {w: jax.random.normal(jax.random.fold_in(key, w), (t, w), jnp.bfloat16) for w in {v[0] for v in parts.values()}}
        row, values = {}, {}
        for form in FORMS:
            @jax.jit
            def step(layers, xs, mask, order, sizes, slots, form=form):
                return sum(project(form, xs[parts[name][0]], layer[name], mask, order, sizes, slots)
                           .astype(jnp.float32).sum() for layer in layers for name in parts)

            values[form] = float(step(layers, xs, mask, order, sizes, slots))
            times = []
            for _ in range(args.reps):
                start = time.perf_counter()
                jax.block_until_ready(step(layers, xs, mask, order, sizes, slots))
                times.append(time.perf_counter() - start)
            row[form] = 1e3 * float(np.median(times))
        for form in FORMS[2:]:  # the forms compute the same step (bf16 sums of the outputs)
            if not np.isclose(values[form], values["masked"], rtol=2e-2):
                raise SystemExit(f"form {form} disagrees with masked: {values[form]} against {values['masked']}")
        results["ms_per_step"][t] = row
        print(f"{t} tokens: " + ", ".join(f"{f} {ms:.3f} ms" + (f" (+{ms - row['base']:.3f})" if f != "base" else "")
                                          for f, ms in row.items()))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"lora_forms_run{args.run_length}.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
