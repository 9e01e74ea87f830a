"""W1 decode latency (DESIGN.md 8): batch 1, a 128-token prompt, 256 greedy tokens; ms per decode step
through `Runner.step` (host work, dispatch and the token's copy back included), against the floor of
reading every weight once per step.

    PYTHONPATH=$PWD python benchmarks/latency.py [--shape llama3-8b|tiny]

Writes $OUT/latency.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import numpy as np

from jaxrunner import CachedRequestData, ModelConfig, NewRequestData, Runner, RunnerConfig, SamplingParams, SchedulerOutput
from jaxrunner.config import RopeScaling
from jaxrunner.models.llama import init_params

SHAPES = {
    "llama3-8b": ModelConfig(
        "LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192), max_position_embeddings=8192,
    ),
    "tiny": ModelConfig("LlamaForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16),
}
COPY_BANDWIDTH = 4.21e12  # bytes/s, DESIGN.md 8


def weight_bytes_per_step(params) -> int:
    """Every weight is read once per decode step except the embedding table, which is only gathered."""
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    return total - (params["embed"].nbytes if "lm_head" in params else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=256)
    args = parser.parse_args()

    model = SHAPES[args.shape]
    dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
    length = args.prompt + args.new
    config = RunnerConfig(max_num_seqs=1, max_num_batched_tokens=args.prompt, max_model_len=length, block_size=16,
                          num_blocks=-(-length // 16), dtype=dtype, token_buckets=(16, args.prompt), request_buckets=(1,))
    params = init_params(model, jax.random.key(0), dtype)
    runner = Runner(model, params, config)
    state = runner.init_state()

    prompt = np.random.default_rng(0).integers(0, model.vocab_size, args.prompt).tolist()
    new = NewRequestData("r", prompt, (list(range(config.num_blocks)),), sampling_params=SamplingParams(temperature=0.0))
    start = time.perf_counter()
    state, _ = runner.step(state, SchedulerOutput([new], num_scheduled_tokens={"r": args.prompt}, total_num_scheduled_tokens=args.prompt))
    first = time.perf_counter() - start

    times = []
    for i in range(args.new - 1):
        sched = SchedulerOutput(
            scheduled_cached_reqs=CachedRequestData(["r"], [None], [args.prompt + i]),
            num_scheduled_tokens={"r": 1}, total_num_scheduled_tokens=1,
        )
        start = time.perf_counter()
        state, out = runner.step(state, sched)
        times.append(time.perf_counter() - start)
    steady = np.array(times[5:]) * 1e3
    floor = weight_bytes_per_step(params) / COPY_BANDWIDTH * 1e3
    result = {
        "device": jax.devices()[0].device_kind, "shape": args.shape, "dtype": dtype,
        "prefill_plus_compile_s": round(first, 2), "first_decode_step_s": round(times[0], 2),
        "decode_ms_median": round(float(np.median(steady)), 3), "decode_ms_mean": round(float(steady.mean()), 3),
        "floor_ms": round(floor, 3), "fraction_of_floor": round(floor / float(np.median(steady)), 3),
    }
    print(json.dumps(result, indent=1))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "latency.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
