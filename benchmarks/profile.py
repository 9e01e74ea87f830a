"""Where a decode step's time goes: a device trace of `Runner.step` calls, summarised per kernel.

The requests start with their context already "computed" (a prefix-cache hit over zeroed pages), so
the first step is already a decode of `--batch` sequences at `--context` tokens and no prefill graph
is compiled. Steps are dispatched as the engine does with async scheduling. Prints, per decode
step: the wall time (untraced), the floor, and from a traced run of as many steps the GPU's busy
time (union of its kernels), its span (busy plus the gaps: host work, launches, copies; tracing
widens them), and the kernels that take the most time.

    PYTHONPATH=$PWD python benchmarks/profile.py --shape llama3-8b --batch 1 --context 128 [--inline-layers] [--batch-invariant] [--quantization F]
Writes $OUT/profile_b{batch}_c{context}_k{decode_steps}[_inline][_invariant][_F].json when OUT is set, with the
first traced step's kernels in order (one layer's chain of kernels is read there).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import tempfile
import time
from collections.abc import Iterator

import jax
import numpy as np
from jax.profiler import ProfileData

from jaxrunner import CachedRequestData, NewRequestData, Runner, RunnerConfig, SamplingParams, SchedulerOutput, platform
from jaxrunner.bench.floors import COPY_BANDWIDTH, weight_bytes_per_step
from jaxrunner.checkpoints.loader import held_config
from jaxrunner.config import QUANTIZATION_FORMATS
from jaxrunner.models import llama
from jaxrunner.models.llama import init_params
from jaxrunner.checkpoints.dummy import SHAPES, shape
from jaxrunner.runner.memory import kv_cache_bytes


def decode_batch(name: str, batch: int, context: int, steps: int, num_steps: int,
                 batch_invariant: bool = False, quantization: str | None = None) -> tuple[Runner, object, list]:
    """A bf16 runner with random weights (the layers' held in `quantization`'s format) and the
    SchedulerOutputs of `steps` decode calls of `batch` requests whose first `context` - 1 tokens
    count as cached (zeroed pages: timing only)."""
    model = held_config(shape(name), quantization)
    dtype = "bfloat16" if platform.on_gpu() else "float32"
    length = context + steps * num_steps + 1
    blocks_per_req = -(-length // 16)
    config = RunnerConfig(
        max_num_seqs=batch, max_num_batched_tokens=max(batch, 16), max_model_len=length, block_size=16,
        num_blocks=batch * blocks_per_req, dtype=dtype, token_buckets=(max(batch, 16),), request_buckets=(batch,),
        num_scheduler_steps=num_steps, batch_invariant=batch_invariant,
    )
    runner = Runner(model, init_params(model, jax.random.key(0), dtype), config)
    ids = [f"r{i}" for i in range(batch)]
    prompt = np.random.default_rng(0).integers(0, model.vocab_size, context).tolist()
    new = [
        NewRequestData(rid, prompt, (list(range(i * blocks_per_req, (i + 1) * blocks_per_req)),), context - 1,
                       SamplingParams(temperature=0.0, max_tokens=None))
        for i, rid in enumerate(ids)
    ]
    scheds = [SchedulerOutput(new, num_scheduled_tokens=dict.fromkeys(ids, 1), total_num_scheduled_tokens=batch)]
    for step in range(1, steps):
        computed = context + (step - 1) * num_steps
        scheds.append(SchedulerOutput(
            scheduled_cached_reqs=CachedRequestData(ids, [None] * batch, [computed] * batch),
            num_scheduled_tokens=dict.fromkeys(ids, 1), total_num_scheduled_tokens=batch, num_steps=num_steps,
        ))
    return runner, runner.init_state(), scheds


def pipelined(runner: Runner, state, scheds: list) -> tuple[object, float]:
    """Dispatch the steps as the engine does with async scheduling (each step's output read after
    the next is dispatched); the state and the seconds taken."""
    start, pending = time.perf_counter(), None
    for sched in scheds:
        state, queued = runner.dispatch(state, sched)
        if pending is not None:
            pending.get()
        pending = queued
    pending.get()
    return state, time.perf_counter() - start


def floor_ms(runner: Runner, batch: int, context: int) -> float:
    """Weights + KV bytes over the copy bandwidth, or the matmul FLOPs at 790 TFLOP/s, whichever is larger."""
    weights = weight_bytes_per_step(runner.params, batch, runner.model_config.num_experts_per_tok)
    per_token_kv = kv_cache_bytes(runner.model_config, RunnerConfig(num_blocks=1, block_size=1, dtype=runner.config.dtype))
    flops = 2 * weights / runner.params["embed"].dtype.itemsize * batch
    return max((weights + batch * context * per_token_kv) / COPY_BANDWIDTH, flops / 790e12) * 1e3


def trace_kernels(run) -> list[tuple[str, int, int]]:
    """Call `run()` under the profiler; the kernels and copies the GPU ran meanwhile."""
    trace_dir = tempfile.mkdtemp()
    with jax.profiler.trace(trace_dir):
        run()
    return gpu_kernels(trace_dir)


def gpu_events(trace_dir: str) -> Iterator[tuple[str, object]]:
    """(the line's name, the event) of every event on the GPU's lines of the trace in `trace_dir`."""
    path = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0]
    for plane in ProfileData.from_file(path).planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                yield from ((line.name, event) for event in line.events)


def gpu_kernels(trace_dir: str) -> list[tuple[str, int, int]]:
    """(name, start ns, end ns) of every kernel and copy the GPU ran in the trace."""
    events = [(e.name, int(e.start_ns), int(e.end_ns)) for line, e in gpu_events(trace_dir) if line.startswith("Stream")]
    return sorted(events, key=lambda e: e[1])


def busy_ns(events: list[tuple[str, int, int]]) -> int:
    """Length of the union of the events' intervals (streams may overlap)."""
    total, end = 0, None
    for _, s, e in events:
        if end is None or s > end:
            total, end = total + e - s, e
        elif e > end:
            total, end = total + e - end, e
    return total


def summarise(events: list[tuple[str, int, int]], steps: int, top: int = 25) -> dict:
    """Per-step busy time, span and kernel count, the `top` kernels by time, and the kernels of the
    first traced decode step in order (name, start and duration in us) to read one layer's sequence."""
    per_kernel = collections.defaultdict(lambda: [0, 0])
    for name, s, e in events:
        per_kernel[name][0] += e - s
        per_kernel[name][1] += 1
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:top]
    span = events[-1][2] - events[0][1] if events else 0
    t0 = events[0][1] if events else 0
    return {
        "gpu_busy_ms_per_step": busy_ns(events) / steps / 1e6,
        "gpu_span_ms_per_step": span / steps / 1e6,
        "kernels_per_step": len(events) / steps,
        "top_kernels": [
            {"name": name[:120], "ms_per_step": round(t / steps / 1e6, 4), "calls_per_step": n / steps}
            for name, (t, n) in ranked
        ],
        "first_step_kernels": [
            [name[:80], round((s - t0) / 1e3, 2), round((e - s) / 1e3, 2)]
            for name, s, e in events[: round(len(events) / steps)]
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--decode-steps", type=int, default=1, help="decode steps per device call")
    parser.add_argument("--inline-layers", action="store_true",
                        help="trace every layer in place instead of calling the jitted llama.decoder_layer")
    parser.add_argument("--batch-invariant", action="store_true", help="the batch-invariant mode's step")
    parser.add_argument("--quantization", choices=QUANTIZATION_FORMATS, help="the layers' weights in this format")
    args = parser.parse_args()
    if args.inline_layers:  # the step as it was lowered before the layer became a jitted function
        llama.decoder_layer = llama.decoder_layer.__wrapped__

    runner, state, scheds = decode_batch(args.shape, args.batch, args.context, 2 * args.steps + 3, args.decode_steps,
                                         args.batch_invariant, args.quantization)
    state, _ = pipelined(runner, state, scheds[:3])  # compile and warm
    state, seconds = pipelined(runner, state, scheds[3 : 3 + args.steps])
    events = trace_kernels(lambda: pipelined(runner, state, scheds[3 + args.steps :]))
    result = {
        "device": jax.devices()[0].device_kind, **vars(args),
        "wall_ms_per_step": seconds / args.steps / args.decode_steps * 1e3,
        "floor_ms": floor_ms(runner, args.batch, args.context),
    }
    result |= summarise(events, args.steps * args.decode_steps)
    print(json.dumps({k: v for k, v in result.items() if k != "first_step_kernels"}, indent=1))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"profile_b{args.batch}_c{args.context}_k{args.decode_steps}{'_inline' * args.inline_layers}"
                               f"{'_invariant' * args.batch_invariant}{'_' + args.quantization if args.quantization else ''}.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
