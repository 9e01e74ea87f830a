"""The Mixture-of-Experts MLP of the Qwen3-30B-A3B shape: GPU busy time per layer for a decode
bucket of 16 tokens with 1 or 16 of them real (the rest padding, sent to no expert), and for 64, 256
and 512 tokens, with XLA's `jax.lax.ragged_dot`, with the grouped matmuls the runner chooses
(`step.moe_matmul`): the Triton kernel (`pallas_kernels.grouped_matmul`, the default on the GPU)
and with `kernels="mosaic"` the Mosaic GPU kernel for a decode's rows
(`quantized_matmul.grouped_dense_matmul`), and in the all-experts dense form (every token times
every expert's weights, which reads each weight once).

    PYTHONPATH=$PWD python benchmarks/moe.py
Writes $OUT/moe.json when OUT is set.
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp

from benchmarks.profile import busy_ns, trace_kernels
from jaxrunner import platform
from jaxrunner.bench.floors import COPY_BANDWIDTH
from jaxrunner.checkpoints.dummy import shape
from jaxrunner.config import Kernels
from jaxrunner.models.moe import moe_mlp, route
from jaxrunner.runner.step import moe_matmul

LAYERS = 8


def dense(x, router, gate_up, down, act, cfg, valid):
    """Every expert on every token, weighted by the router's top k (zero elsewhere)."""
    weights, experts = route(x @ router, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    mix = jnp.zeros((x.shape[0], cfg.num_experts), x.dtype).at[jnp.arange(x.shape[0])[:, None], experts].set(
        weights.astype(x.dtype)) * valid[:, None]
    gate, up = jnp.split(jnp.einsum("th,ehi->tei", x, gate_up), 2, axis=-1)
    return jnp.einsum("tei,eih,te->th", act(gate) * up, down, mix)


def main() -> None:
    if jax.default_backend() != "gpu":
        raise SystemExit("benchmarks/moe.py needs a GPU: its times come from a device trace")
    cfg = shape("qwen3-30b-a3b")
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    key = iter(jax.random.split(jax.random.key(0), 3 * LAYERS + 3))
    layers = [(jax.random.normal(next(key), (h, e), jnp.bfloat16) * 0.05,
               jax.random.normal(next(key), (e, h, 2 * i), jnp.bfloat16) * 0.02,
               jax.random.normal(next(key), (e, i, h), jnp.bfloat16) * 0.02) for _ in range(LAYERS)]
    expert_bytes = 2 * 3 * h * i
    results = {"device": jax.devices()[0].device_kind, "shape": "qwen3-30b-a3b", "cases": []}
    forms = {"ragged_dot": moe_mlp, "dense": dense}
    for name, mosaic in (("pallas", False), ("mosaic", True)):
        kernels = Kernels(pallas=True, interpret=False, num_sms=platform.num_sms(), mosaic=mosaic)
        forms[name] = functools.partial(moe_mlp, grouped_matmul=moe_matmul(kernels, cfg))
    for tokens, real in ((16, 1), (16, 16), (64, 64), (256, 256), (512, 512)):
        x = jax.random.normal(next(key), (tokens, h), jnp.bfloat16)
        valid = jnp.arange(tokens) < real
        for name, fn in forms.items():
            call = jax.jit(lambda x, layers, valid, fn=fn: [fn(x, *w, jax.nn.silu, cfg, valid) for w in layers])
            jax.block_until_ready(call(x, layers, valid))
            events = trace_kernels(lambda: [jax.block_until_ready(call(x, layers, valid)) for _ in range(3)])
            us = busy_ns(events) / (3 * LAYERS) / 1e3
            _, experts = route(x[:real] @ layers[0][0], cfg.num_experts_per_tok, True)
            used = len(set(experts.reshape(-1).tolist()))
            floor_us = used * expert_bytes / COPY_BANDWIDTH * 1e6
            case = {"tokens": tokens, "real": real, "form": name, "us_per_layer": us, "experts_used": used,
                    "floor_us": floor_us}
            results["cases"].append(case)
            print(f"T={tokens:4d} real={real:4d} {name:10s} {us:8.1f} us/layer; {used} experts used, reading "
                  f"them once takes {floor_us:.1f} us", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "moe.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
