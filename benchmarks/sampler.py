"""Sampler benchmark: our sort-free sampler against a plain sort-based XLA sampler, in one run.

Batch 256, vocabulary 128256 (Llama 3), mixed parameters: greedy and random rows, top-k, top-p,
min-p, penalties over a token history, logprobs. Both samplers share everything except the
top-k/top-p step: ours searches each row's threshold (jaxrunner.sampling.truncation), the baseline
sorts every row (jnp.sort) and cuts at the cumulative probability, as vLLM's PyTorch path does. The
truncation steps are also timed alone, ours also with the search's tally in XLA instead of the
Pallas kernel (on CPU both run the XLA tally). Each case is jitted, warmed up, then timed call by call
with block_until_ready; the table shows the median. Both samplers draw the same noise, so their
tokens must agree: the agreement is printed as a check.

    python benchmarks/sampler.py            # GPU: batch 256, vocab 128256
    python benchmarks/sampler.py --small    # CPU check: batch 16, vocab 4096
Writes $OUT/sampler.json when OUT is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrunner.config import Kernels, SamplerConfig
from jaxrunner.sampling import (
    SamplerFlags,
    build_sampling_metadata,
    compute_logprobs,
    prepare_request,
    process_logits,
    sample,
)
from jaxrunner.sampling.sampler import gumbel_noise
from jaxrunner.sampling.truncation import top_k_top_p
from jaxrunner.sampling_params import SamplingParams

KERNELS = Kernels.choose("auto")  # the Pallas tally on a GPU, the XLA tally elsewhere
XLA_TALLY = Kernels(pallas=False, interpret=False, num_sms=KERNELS.num_sms)


def sort_top_k_top_p(x: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """The baseline, as vLLM's PyTorch path: sort each row ascending, cut below the k-th largest, then
    drop the prefix whose cumulative probability is <= 1 - p (never the largest)."""
    ordered = jnp.sort(x, axis=1)
    kth = jnp.take_along_axis(ordered, x.shape[1] - top_k[:, None], axis=1)
    ordered = jnp.where(ordered < kth, -jnp.inf, ordered)
    drop = jnp.cumsum(jax.nn.softmax(ordered, axis=1), axis=1) <= 1.0 - top_p[:, None]
    drop = drop.at[:, -1].set(False)
    cut = jnp.min(jnp.where(drop, jnp.inf, ordered), axis=1, keepdims=True)
    return jnp.where(x < cut, -jnp.inf, x)


def sort_sample(logits: jax.Array, md, flags: SamplerFlags, history: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The same sampler with the sort-based cut: (tokens, logprobs)."""
    x = process_logits(logits, md, dataclasses.replace(flags, top_k_top_p=False), history, KERNELS)
    x = sort_top_k_top_p(x, md.top_k, md.top_p)
    greedy = (md.temperature == 0.0)[:, None]
    tokens = jnp.argmax(jnp.where(greedy, x, x + gumbel_noise(md.seeds, md.positions, x.shape[1])), axis=1)
    values, _, _ = compute_logprobs(logits, tokens.astype(jnp.int32), flags.num_logprobs)
    return tokens.astype(jnp.int32), values


def mixed_batch(batch: int, vocab: int, history_len: int, rng: np.random.Generator):
    config = SamplerConfig()
    requests, prompt_lens = [], rng.integers(history_len // 4, history_len // 2, batch)
    for i in range(batch):
        params = SamplingParams(
            temperature=float(rng.choice([0.0, 0.6, 0.8, 1.0, 1.2])),
            top_k=int(rng.choice([-1, 20, 50, 200, 1000])),
            top_p=float(rng.choice([1.0, 0.8, 0.9, 0.95])),
            min_p=float(rng.choice([0.0, 0.0, 0.05])),
            repetition_penalty=1.1 if i % 4 == 0 else 1.0,
            frequency_penalty=0.2 if i % 4 == 0 else 0.0,
            presence_penalty=0.3 if i % 4 == 0 else 0.0,
            logprobs=5 if i % 4 == 1 else None,
        )
        requests.append(prepare_request(params, int(rng.integers(0, 2**63)), int(prompt_lens[i]), config, vocab))
    positions = rng.integers(history_len // 2, history_len, batch)
    md, flags = build_sampling_metadata(requests, positions.tolist(), batch, config, vocab)
    # Llama-like logits: a broad bulk and a few tokens well above it.
    logits = rng.normal(0.0, 2.0, (batch, vocab)).astype(np.float32)
    logits[np.arange(batch)[:, None], rng.integers(0, vocab, (batch, 8))] += rng.uniform(4, 12, (batch, 8))
    history = rng.integers(0, vocab, (batch, history_len)).astype(np.int32)
    return config, md, flags, logits, history


def time_calls(fn, args, warmup: int, iters: int) -> dict[str, float]:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="batch 16, vocab 4096, history 256 (CPU check)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--history", type=int, default=2048, help="token history length per row (penalties)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    if args.small:
        args.batch, args.vocab, args.history, args.iters = 16, 4096, 256, 5

    config, md, flags, logits, history = mixed_batch(args.batch, args.vocab, args.history, np.random.default_rng(0))
    md, logits, history = jax.device_put((md, logits, history))
    plain = SamplerFlags(count_nans=flags.count_nans)
    no_cut = dataclasses.replace(flags, top_k_top_p=False)
    scaled = jax.jit(process_logits, static_argnums=(2, 4))(logits, md, no_cut, history, KERNELS)

    ours = jax.jit(functools.partial(sample, kernels=KERNELS), static_argnums=2)
    truncate = jax.jit(functools.partial(top_k_top_p, kernels=KERNELS))
    baseline = jax.jit(sort_sample, static_argnums=2)
    cases = {
        "sampler, mixed params (ours)": (ours, (logits, md, flags, history)),
        "sampler, mixed params (sort baseline)": (baseline, (logits, md, flags, history)),
        "top-k/top-p alone (ours)": (truncate, (scaled, md.top_k, md.top_p)),
        "top-k/top-p alone (ours, XLA tally)": (
            jax.jit(functools.partial(top_k_top_p, kernels=XLA_TALLY)), (scaled, md.top_k, md.top_p)),
        "top-k/top-p alone (sort baseline)": (jax.jit(sort_top_k_top_p), (scaled, md.top_k, md.top_p)),
        "sampler, temperature only (floor)": (ours, (logits, md, plain, history)),
    }
    results = {name: time_calls(fn, fn_args, args.warmup, args.iters) for name, (fn, fn_args) in cases.items()}

    tokens = np.asarray(ours(logits, md, flags, history).tokens)
    agreement = float(np.mean(tokens == np.asarray(baseline(logits, md, flags, history)[0])))
    same_cut = float(np.mean(np.asarray(truncate(scaled, md.top_k, md.top_p))
                             == np.asarray(jax.jit(sort_top_k_top_p)(scaled, md.top_k, md.top_p))))
    speedup = {
        "sampler": results["sampler, mixed params (sort baseline)"]["median_ms"]
        / results["sampler, mixed params (ours)"]["median_ms"],
        "top_k_top_p": results["top-k/top-p alone (sort baseline)"]["median_ms"]
        / results["top-k/top-p alone (ours)"]["median_ms"],
    }

    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}")
    print(f"batch {args.batch}, vocab {args.vocab}, history {args.history}, flags {flags}")
    print(f"{'case':<42} {'median ms':>10} {'min ms':>10}")
    for name, r in results.items():
        print(f"{name:<42} {r['median_ms']:>10.3f} {r['min_ms']:>10.3f}")
    print(
        f"speed-up over the sort baseline: sampler {speedup['sampler']:.2f}x, "
        f"top-k/top-p {speedup['top_k_top_p']:.2f}x"
    )
    print(f"same tokens as the baseline: {agreement:.4f} of rows; same cut logits: {same_cut:.6f} of entries")

    if os.environ.get("OUT"):
        report = {
            "device": device.device_kind,
            "platform": device.platform,
            "jax": jax.__version__,
            "batch": args.batch,
            "vocab": args.vocab,
            "history": args.history,
            "flags": dataclasses.asdict(flags),
            "results": results,
            "speedup": speedup,
            "token_agreement": agreement,
            "cut_agreement": same_cut,
        }
        with open(os.path.join(os.environ["OUT"], "sampler.json"), "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
