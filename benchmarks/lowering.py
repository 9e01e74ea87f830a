"""Start-up's Python half: the time to plan warm-up's synthetic steps (`plans_seconds`), then to
lower (trace, then emit StableHLO and the Pallas kernels' Triton IR) every program `Runner.warmup`
compiles for an H200, with the engine's default GPU
configuration. Lowering holds the GIL, so unlike XLA's compiles it does not spread over cores. Runs
on any machine: the runner is built as on a GPU (`jaxrunner.platform` answers "on a GPU") and the Pallas
lowering targets an abstract H200; nothing is compiled or allocated.

    PYTHONPATH=$PWD python benchmarks/lowering.py --shape qwen3-0.6b
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from unittest import mock

import jax

from jaxrunner import Runner, RunnerConfig
from jaxrunner.models.llama import init_params
from jaxrunner.checkpoints.dummy import SHAPES, shape
from jaxrunner.models.tensors import MODEL_AXIS
from jaxrunner.platform import H200


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--max-model-len", type=int, default=1536)
    parser.add_argument("--num-scheduler-steps", type=int, default=8)
    args = parser.parse_args()

    model = shape(args.shape)
    config = RunnerConfig(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=args.max_model_len,
                          num_blocks=64, dtype="bfloat16", num_scheduler_steps=args.num_scheduler_steps)
    seconds = collections.defaultdict(list)
    # An H200 whose one axis is the one the programs' sharding constraints name.
    gpu = jax.sharding.AbstractMesh((1,), (MODEL_AXIS,), axis_types=(jax.sharding.AxisType.Auto,),
                                    abstract_device=H200.abstract_device)
    with mock.patch("jaxrunner.platform.on_gpu", return_value=True), jax.sharding.use_abstract_mesh(gpu):
        runner = Runner(model, jax.eval_shape(lambda: init_params(model, jax.random.key(0), "bfloat16")), config)
        start = time.perf_counter()
        programs = runner.programs.warmup_programs()  # the plans of warm-up's schedules, made on every start
        plans_seconds = time.perf_counter() - start
        for program in programs:
            start = time.perf_counter()
            program.kind.jitted.trace(*program.args, **program.statics).lower(lowering_platforms=("cuda",))
            seconds[program.key[0]].append(time.perf_counter() - start)
    result = {**vars(args), "plans_seconds": round(plans_seconds, 3), "programs": sum(map(len, seconds.values())),
              "lower_seconds": round(sum(map(sum, seconds.values())), 1),
              "by_function": {name: {"programs": len(s), "seconds": round(sum(s), 2), "slowest": round(max(s), 2)}
                              for name, s in seconds.items()}}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
