"""Soak the engine: many requests of random lengths and sampling, random aborts, on the built-in model.

    python scripts/soak.py --num-requests 2000      # prints a JSON report; exit status 1 if anything is wrong

Requests arrive while others run (up to `--live` at a time); each step aborts a running request with
probability `--abort-rate`. Checked at the end: every request got exactly one final output, with
"abort" for those aborted and "stop" or "length" for the rest, within its max_tokens; nothing is
left queued or in flight; every KV block is free; and a greedy canary request gives the same tokens
before and after. `tests/test_reliability.py` runs it with a small count.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from jaxrunner import LLM, SamplingParams

ENGINE = {"model": "jaxrunner-tiny-random", "max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 128, "num_gpu_blocks_override": 40,
          "block_size": 8}
CANARY = ("The canary sings", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
WORDS = ["alpha", "beta", "gamma", "delta", "tree", "river", "stone", "cloud", "seven", "blue"]


def random_request(rng: random.Random) -> tuple[str, SamplingParams]:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 16)))
    params = SamplingParams(
        n=rng.choice([1, 1, 1, 2]),
        max_tokens=rng.randint(1, 40),
        temperature=rng.choice([0.0, 0.7, 1.0]),
        top_k=rng.choice([-1, -1, 5, 40]),
        top_p=rng.choice([1.0, 1.0, 0.9]),
        seed=rng.choice([None, rng.randrange(2**32)]),
        presence_penalty=rng.choice([0.0, 0.0, 0.5]),
        stop=rng.choice([None, None, ["e"], ["a b"]]),
        logprobs=rng.choice([None, None, 2]),
        ignore_eos=rng.random() < 0.5,
    )
    return prompt, params


def soak(num_requests: int = 2000, seed: int = 0, live: int = 12, abort_rate: float = 0.05) -> dict:
    """Run the soak; a report whose `ok` says whether every check held."""
    rng = random.Random(seed)
    start = time.perf_counter()
    with LLM(**ENGINE) as llm:
        engine = llm.llm_engine
        canary_before = llm.generate(*CANARY, use_tqdm=False)[0].outputs[0].token_ids
        params_of: dict[str, SamplingParams] = {}
        finals: dict[str, list] = {}
        aborted: set[str] = set()
        added = steps = 0
        while added < num_requests or engine.has_unfinished_requests():
            while added < num_requests and len(params_of) - len(finals) < live:
                prompt, params = random_request(rng)
                request_id = f"soak-{added}"
                engine.add_request(request_id, prompt, params)
                params_of[request_id] = params
                added += 1
            for out in engine.step():
                if out.finished:
                    finals.setdefault(out.request_id, []).append(out)
            steps += 1
            running = sorted(set(params_of) - set(finals) - aborted)
            if running and rng.random() < abort_rate:
                victim = rng.choice(running)
                engine.abort_request([victim])
                aborted.add(victim)
        engine.drain()
        manager, stats = engine.block_manager, engine.stats()
        canary_after = llm.generate(*CANARY, use_tqdm=False)[0].outputs[0].token_ids

    wrong = []
    for request_id, params in params_of.items():
        outs = finals.get(request_id, [])
        if len(outs) != 1:
            wrong.append(f"{request_id}: {len(outs)} final outputs")
            continue
        reasons = {c.finish_reason for c in outs[0].outputs}
        allowed = {"abort", "stop", "length"} if request_id in aborted else {"stop", "length"}
        if len(outs[0].outputs) != params.n and request_id not in aborted or not reasons <= allowed:
            wrong.append(f"{request_id}: {len(outs[0].outputs)} completions, finish reasons {sorted(reasons)}")
        if any(len(c.token_ids) > params.max_tokens for c in outs[0].outputs):
            wrong.append(f"{request_id}: more than max_tokens={params.max_tokens} tokens")
    report = {
        "requests": num_requests,
        "aborted": len(aborted),
        "steps": steps,
        "preemptions": stats.num_preemptions,
        "seconds": round(time.perf_counter() - start, 1),
        "wrong": wrong[:20],
        "leaked_blocks": manager.num_blocks - manager.num_free_blocks,
        "left_running": engine.has_unfinished_requests(),
        "canary_same": canary_before == canary_after,
    }
    report["ok"] = not wrong and not report["leaked_blocks"] and not report["left_running"] and report["canary_same"]
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--live", type=int, default=12, help="requests queued or running at a time")
    parser.add_argument("--abort-rate", type=float, default=0.05, help="chance per step of aborting a request")
    args = parser.parse_args()
    report = soak(args.num_requests, args.seed, args.live, args.abort_rate)
    print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
