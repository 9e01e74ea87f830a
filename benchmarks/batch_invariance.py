"""Whether a request keeps its bits inside a batch at W2's scale: with `batch_invariant` on and off,
a target request alone, then among `--batch` requests of W2's prompt lengths (the target at a
random place), greedy and seeded at temperature 1. Random weights of `--shape`, bf16. Prints where
its tokens first differ and the largest logprob difference, per mode, and the largest difference of
its prompt logprobs (the prefill's). The mode's cost is
`jaxrunner bench latency|throughput --batch-invariant` beside the same without it.

    PYTHONPATH=$PWD python3 benchmarks/batch_invariance.py [--shape qwen3-0.6b] [--batch 256] [--kernels pallas]
Writes $OUT/batch_invariance.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import numpy as np

from jaxrunner import LLM, SamplingParams
from jaxrunner.checkpoints.dummy import SHAPES, shape


def compare(llm: LLM, target: list[int], others: list[list[int]], params: SamplingParams, place: int) -> dict:
    def run(prompts: list[list[int]], at: int):
        found = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)[at]
        out = found.outputs[0]
        prompt_lp = [lp[t].logprob for t, lp in zip(found.prompt_token_ids[1:], found.prompt_logprobs[1:])]
        return out.token_ids, [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)], prompt_lp

    (alone, alone_lp, alone_prompt), (batched, batched_lp, batched_prompt) = (
        run([target], 0), run(others[:place] + [target] + others[place:], place))
    differ = next((i for i, (a, b) in enumerate(zip(alone, batched)) if a != b), None)
    same = len(alone) if differ is None else differ
    return {"tokens_equal": alone == batched, "first_differing_token": differ,
            "max_logprob_difference": float(np.max(np.abs(np.subtract(alone_lp[:same], batched_lp[:same])), initial=0.0)),
            "max_prompt_logprob_difference": float(np.max(np.abs(np.subtract(alone_prompt, batched_prompt))))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--kernels", choices=("auto", "pallas", "reference"), default="auto",
                        help="the engine's kernels (pallas off a GPU: interpreted)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    vocab = shape(args.shape).vocab_size
    target = rng.integers(0, vocab, 300).tolist()
    others = [rng.integers(0, vocab, n).tolist() for n in rng.integers(100, 1025, args.batch - 1)]
    place = int(rng.integers(0, args.batch))
    result = {"device": jax.devices()[0].device_kind, **vars(args), "place": place}
    for invariant in (False, True):
        llm = LLM(args.shape, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024 + args.new,
                  batch_invariant=invariant, enable_prefix_caching=False, kernels=args.kernels)
        for name, params in (("greedy", SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True, logprobs=0,
                                                      prompt_logprobs=0)),
                             ("seeded", SamplingParams(temperature=1.0, seed=3, max_tokens=args.new, ignore_eos=True,
                                                       logprobs=0, prompt_logprobs=0))):
            result[f"{'invariant' if invariant else 'default'}_{name}"] = compare(llm, target, others, params, place)
        del llm
    print(json.dumps(result, indent=1))
    if out := os.environ.get("OUT"):
        with open(os.path.join(out, "batch_invariance.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
