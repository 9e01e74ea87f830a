"""The Hugging Face transformers peer of `jaxrunner bench` (docs/design.md, "Workloads"): the same workload, random
weights in the same shape, measured in the same invocation so every claim is a ratio.

This module imports only the standard library at module level, and torch and transformers inside
the functions that need them, so it runs where jax is absent. The bench commands run it as a script
in a fresh process, before measuring jaxrunner, so that each side gets the whole GPU:

    python jaxrunner/bench/hf_peer.py SPEC.json RESULT.json

SPEC holds `workload` ("latency" or "throughput"), `config` (a Hugging Face config.json as a dict),
`prompts` (lists of token ids), `new` (tokens per request), `seed`, and optionally `compile`
(latency: torch.compile the decode step, default true) and `allow_cpu` (run without a CUDA GPU, in
float32: for tests; the figures mean nothing there).
"""

from __future__ import annotations

import importlib.machinery
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def peer_unavailable() -> str | None:
    """Why the peer cannot run in this Python (None: it can). Only looks for the packages on the
    path, so the caller's process never imports torch (and may bar it: `cli.console_main`); the CUDA
    check is the peer process's own."""
    missing = [name for name in ("torch", "transformers") if importlib.machinery.PathFinder.find_spec(name) is None]
    return f"{' and '.join(missing)} not importable" if missing else None


def run(spec: dict) -> dict:
    """Measure the peer in a fresh Python process. On success, the peer's figures; otherwise
    {"skipped": why}, after a one-line note on stderr."""
    if reason := peer_unavailable():
        return _skipped(reason)
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, result_path = Path(tmp, "spec.json"), Path(tmp, "result.json")
        spec_path.write_text(json.dumps(spec))
        # -P: the script's folder (latency.py, shapes.py, ...) must not shadow top-level modules
        done = subprocess.run([sys.executable, "-P", __file__, str(spec_path), str(result_path)])
        if done.returncode != 0 or not result_path.exists():
            return _skipped(f"the peer process failed with exit status {done.returncode} (its output is above)")
        result = json.loads(result_path.read_text())
    return _skipped(result["skipped"]) if "skipped" in result else result


def _skipped(reason: str) -> dict:
    print(f"HF transformers peer skipped: {reason}", file=sys.stderr)
    return {"skipped": reason}


def measure(spec: dict) -> dict:
    """The peer's figures for `spec` (see the module docstring), in this process."""
    import torch

    if not torch.cuda.is_available() and not spec.get("allow_cpu", False):
        return {"skipped": "torch sees no CUDA GPU"}
    latency = spec["workload"] == "latency"
    model = load_model(spec["config"], "sdpa" if latency else "paged|sdpa", spec["seed"])
    if latency:
        figures = measure_latency(model, spec["prompts"], spec["new"], spec.get("compile", True))
    else:
        figures = measure_throughput(model, spec["prompts"], spec["new"])
    return {**_versions(model), **figures}


def load_model(config: dict, attn_implementation: str, seed: int):
    """A causal LM with random weights in the shape `config` describes: bf16 on the GPU, else fp32 on CPU."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cuda = torch.cuda.is_available()
    torch.manual_seed(seed)
    with torch.device("cuda" if cuda else "cpu"):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(**config),
            dtype=torch.bfloat16 if cuda else torch.float32,
            attn_implementation=attn_implementation,
        )
    return model.eval()


def measure_latency(model, prompts: list[list[int]], new: int, compile: bool = True) -> dict:
    """Batch-1 greedy `generate` with a static KV cache, its decode step compiled by torch.compile
    (transformers compiles it itself when the cache is static and the device a GPU). ms per decode
    step = (time for `new` tokens - time for 1) / (new - 1), so the prefill cancels out. The first
    prompt warms up (compilation and CUDA graph recording); each of the others is one timed run."""
    import torch
    from transformers import CompileConfig, GenerationConfig

    def seconds(prompt: list[int], tokens: int) -> float:
        config = GenerationConfig(
            do_sample=False,
            max_new_tokens=tokens,
            min_new_tokens=tokens,  # EOS is ignored
            cache_implementation="static",
            max_cache_len=max(map(len, prompts)) + new,  # one cache size for every call: no recompilation
            compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead") if compile else None,
            disable_compile=not compile,
        )
        ids = torch.tensor([prompt], device=model.device)
        _synchronize()
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        _synchronize()
        if out.shape[1] != len(prompt) + tokens:
            raise RuntimeError(f"HF generate returned {out.shape[1] - len(prompt)} tokens, not {tokens}")
        return time.perf_counter() - start

    warm, *timed = prompts
    for _ in range(2):
        seconds(warm, new)
        seconds(warm, 1)
    first_ms, step_ms = [], []
    for prompt in timed:
        first = seconds(prompt, 1)
        full = seconds(prompt, new)
        first_ms.append(first * 1e3)
        step_ms.append((full - first) / (new - 1) * 1e3)
    return {
        "method": "generate, static cache, " + ("torch.compile (reduce-overhead, fullgraph)" if compile else "eager"),
        "ttft_ms": statistics.median(first_ms),
        "decode_ms_per_step": statistics.median(step_ms),
        "decode_ms_per_step_all": step_ms,
    }


def measure_throughput(model, prompts: list[list[int]], new: int) -> dict:
    """Continuous batching with `generate_batch` (paged attention over SDPA), greedy, no EOS.
    Elapsed time runs from the first request's arrival to the last one's end, so the manager's
    start-up (CUDA graph capture) is left out, as jaxrunner's compilation is; `wall_s` includes it."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1)  # -1: no EOS
    cache = None
    if model.device.type == "cpu":  # a check, not a measurement: a cache for this workload, not 90% of free RAM
        block = ContinuousBatchingConfig().block_size
        blocks = sum(-(-(len(p) + new) // block) for p in prompts)
        cache = ContinuousBatchingConfig(num_blocks=blocks, max_batch_tokens=block)
    start = time.perf_counter()
    outputs = model.generate_batch(
        inputs=prompts, generation_config=config, continuous_batching_config=cache, progress_bar=True
    ).values()
    wall = time.perf_counter() - start
    failed = len(prompts) - sum(o.error is None for o in outputs)
    if failed:
        raise RuntimeError(f"HF generate_batch: {failed} of {len(prompts)} requests failed or went missing")
    tokens = sum(len(o.generated_tokens) for o in outputs)
    elapsed = max(o.lifespan[1] for o in outputs) - min(o.created_time for o in outputs)
    return {
        "method": "generate_batch, paged|sdpa",
        "elapsed_s": elapsed,
        "wall_s": wall,
        "output_tokens": tokens,
        "tokens_per_s": tokens / elapsed,
    }


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _versions(model) -> dict:
    import torch
    import transformers

    device = torch.cuda.get_device_name() if model.device.type == "cuda" else "cpu"
    return {"transformers": transformers.__version__, "torch": torch.__version__, "device": device,
            "dtype": str(model.dtype).removeprefix("torch.")}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    Path(argv[1]).write_text(json.dumps(measure(spec)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def summary_lines(peer: dict, figure: str, speedup: float | None, how: str) -> list[str]:
    """The peer's lines of a bench summary: its figure (a format string over the peer's result), and
    our speed relative to it."""
    if "skipped" in peer:
        return [f"  HF transformers: skipped ({peer['skipped']})"]
    return [
        f"  HF transformers {peer['transformers']} ({peer['method']}): {figure.format(**peer)}",
        f"  jaxrunner is {speedup:.2f}x the peer's speed ({how})",
    ]
