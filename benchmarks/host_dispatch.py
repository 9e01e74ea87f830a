"""The host's time per step with `--decoders` requests decoding one token a step (no multi-step
decode, the engine's default): the step's milliseconds, and the host's milliseconds in each kind
of program's dispatch (medians over `--steps` steps). Such steps are paced by the host, not the GPU,
so this is what a serving step's overhead is made of. Run it under different `XLA_FLAGS` to see
what the executables' launch costs (e.g. `--xla_gpu_enable_command_buffer=` turns CUDA graphs off).

    PYTHONPATH=$PWD python3 benchmarks/host_dispatch.py [--shape llama3-8b] [--decoders 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from jaxrunner.checkpoints.dummy import SHAPES
from jaxrunner.engine.engine import LLMEngine
from jaxrunner.engine.engine_args import EngineArgs
from jaxrunner.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--decoders", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    engine = LLMEngine(EngineArgs(
        model=args.shape, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048,
        max_num_seqs=args.decoders + 2, max_num_batched_tokens=2048, num_gpu_blocks_override=2000,
        enforce_eager=True))
    programs, dispatches = engine.runner.programs, {}
    run = programs.run

    def timed(kind, **named):
        start = time.perf_counter()
        try:
            return run(kind, **named)
        finally:
            dispatches.setdefault(kind.name, []).append(time.perf_counter() - start)

    programs.run = timed
    rng = np.random.default_rng(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=40 + args.steps + 1, ignore_eos=True)
    for i in range(args.decoders):
        engine.add_request(f"decode-{i}", {"prompt_token_ids": rng.integers(3, vocab, args.prompt).tolist()}, params)
    for _ in range(40):  # the prefills, and every program's first run
        engine.step()
    dispatches.clear()
    steps = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    result = {"shape": args.shape, "decoders": args.decoders, "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "step_ms": round(1e3 * statistics.median(steps), 3),
              "dispatch_ms": {name: round(1e3 * statistics.median(s), 3) for name, s in dispatches.items()}}
    print(json.dumps(result))
    engine.abort_request([f"decode-{i}" for i in range(args.decoders)], final_output=False)
    engine.close()


if __name__ == "__main__":
    main()
