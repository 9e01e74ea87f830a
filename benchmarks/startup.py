"""Engine start-up for a benchmark shape with the default GPU configuration: KV sizing, then every
program compiled ahead of time. Run it twice: the second run reads JAX's persistent compilation
cache (~/.cache/jaxrunner/xla), so it gives the cached figure.

    PYTHONPATH=$PWD python benchmarks/startup.py --shape llama3-8b [--num-scheduler-steps 8] [--compile-in-background] [--time-first-runs] [--runs-again N]

With --compile-in-background the engine starts on the largest buckets' programs; the figure beside
its start is when the warm-up thread has compiled the rest (`join_warmup`). With --time-first-runs
every program call is waited for, which serialises the runs, and each program's first run timed
(`first_run_seconds_by_kind`: programs, seconds, the longest; and the slowest programs); only a
GPU start that compiled programs runs them before serving (`Runner.run_each_once`): a CPU start,
or one that found every program in the program cache, has none.
--runs-again N then calls `run_each_once` N more times after the start: what its schedules cost
once every program has run (`runs_again_seconds`, and with --time-first-runs every call of each
pass by kind, `calls_by_pass`: calls, seconds, the longest), against the start's first runs.
Writes $OUT/startup_{shape}_{n}.json when OUT is set (n counts the runs already written).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import logging
import os
import time

import jax

from jaxrunner.engine import LLM
from jaxrunner.runner import programs as runner_programs
from jaxrunner.checkpoints.dummy import SHAPES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--num-scheduler-steps", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--compile-in-background", action="store_true")
    parser.add_argument("--time-first-runs", action="store_true")
    parser.add_argument("--runs-again", type=int, default=0)
    args = parser.parse_args()
    passes: list[dict] = [collections.defaultdict(list)]  # per pass of run_each_once: kind -> seconds of each call
    first_runs = time_first_runs(passes) if args.time_first_runs else {}
    logging.basicConfig(level=logging.INFO)
    start = time.perf_counter()
    llm = LLM(args.shape, load_format="dummy", skip_tokenizer_init=True, max_model_len=args.max_model_len,
              num_scheduler_steps=args.num_scheduler_steps, enforce_eager=False,
              compile_in_background=args.compile_in_background)
    result = {**vars(args), "engine_start_s": round(time.perf_counter() - start, 2), **llm.llm_engine.startup}
    if args.compile_in_background:
        llm.llm_engine.runner.join_warmup()
        result["every_program_ready_s"] = round(time.perf_counter() - start, 2)
    engine, again = llm.llm_engine, []
    for _ in range(args.runs_again):
        passes.append(collections.defaultdict(list))
        start = time.perf_counter()
        engine.state = jax.block_until_ready(engine.runner.run_each_once(engine.state))
        again.append(round(time.perf_counter() - start, 3))
    if again:
        result["runs_again_seconds"] = again
    if first_runs:
        by_kind = collections.defaultdict(list)
        for key, seconds in first_runs.items():
            by_kind[key[0]].append(seconds)
        result["first_run_seconds_by_kind"] = {kind: [len(s), round(sum(s), 3), round(max(s), 3)]
                                               for kind, s in by_kind.items()}
        slowest = sorted(first_runs.items(), key=lambda item: item[1], reverse=True)[:8]
        result["slowest_first_runs"] = [[" ".join(map(str, key[:2])), round(s, 3)] for key, s in slowest]
    if args.time_first_runs:  # a CPU or cached start runs nothing, but the passes after it do
        result["calls_by_pass"] = [{kind: [len(s), round(sum(s), 3), round(max(s), 3)] for kind, s in calls.items()}
                                   for calls in passes]
    print(json.dumps(result, indent=1))
    if out := os.environ.get("OUT"):
        n = len(glob.glob(os.path.join(out, f"startup_{args.shape}_*.json")))
        with open(os.path.join(out, f"startup_{args.shape}_{n}.json"), "w") as f:
            json.dump(result, f, indent=1)


def time_first_runs(passes: list[dict]) -> dict:
    """Each program's first run, waited for: `Programs.run` wrapped (program key -> seconds). Every
    call is waited for and its seconds added to the last of `passes` under its kind."""
    seen: dict = {}
    run = runner_programs.Programs.run

    def timed(self, kind, **named):
        key = self.program(kind, **named).key
        start = time.perf_counter()
        out = jax.block_until_ready(run(self, kind, **named))
        seconds = time.perf_counter() - start
        if len(passes) == 1:  # the start's own runs; a background warm-up's later tiers first run in --runs-again
            seen.setdefault(key, seconds)
        passes[-1][kind.name].append(seconds)
        return out

    runner_programs.Programs.run = timed
    return seen


if __name__ == "__main__":
    main()
