"""`jaxrunner bench throughput`, workload W2 (docs/design.md): 256 requests with prompt lengths uniform
in [100, 1024], 512 greedy new tokens each (EOS ignored), random weights in the Qwen3-0.6B shape;
output tokens per second end to end through `LLM.generate`, against Hugging Face transformers'
continuous batching (`generate_batch`) on the same prompts when it can run. With `num_loras`, every
request runs with one of that many random PEFT adapters of rank `lora_rank` (round robin), each
adapting all seven projections.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time

import jax
import numpy as np
from safetensors.numpy import save_file

from jaxrunner.bench import hf_peer
from jaxrunner.bench.latency import hf_config, spec_lines
from jaxrunner.config import ModelConfig
from jaxrunner.engine.llm import LLM
from jaxrunner.lora.adapters import MODULES, WEIGHTS_FILE
from jaxrunner.lora_request import LoRARequest
from jaxrunner.lora.slots import projection_parts
from jaxrunner.checkpoints.dummy import shape
from jaxrunner.sampling_params import SamplingParams

WARMUP_REQUESTS = 4


def run(
    shape_name: str = "qwen3-0.6b",
    num_prompts: int = 256,
    min_prompt: int = 100,
    max_prompt: int = 1024,
    new: int = 512,
    num_scheduler_steps: int = 8,
    async_scheduling: bool = True,
    seed: int = 0,
    peer: bool = True,
    speculative_config: dict | None = None,
    num_loras: int = 0,
    lora_rank: int = 16,
    tensor_parallel_size: int = 1,
    quantization: str | None = None,
    data_parallel_size: int = 1,
    gpu_memory_utilization: float | None = None,
    batch_invariant: bool = False,
    kernels: str = "auto",
    trace_dir: str | None = None,
) -> dict:
    """A short warm-up generation (a few requests, prompts of their own so the prefix cache cannot
    serve the timed ones), then one timed `generate` of all the requests; the peer runs first, in
    its own process, on the same prompts. With `trace_dir`, the timed `generate` runs under JAX's
    profiler, which writes its trace there (`benchmarks/w2_profile.py` reads it)."""
    if num_prompts < 1 or new < 1 or not 1 <= min_prompt <= max_prompt:
        raise ValueError(f"need num_prompts >= 1, new >= 1 and 1 <= min_prompt <= max_prompt; got "
                         f"num_prompts={num_prompts}, new={new}, min_prompt={min_prompt}, max_prompt={max_prompt}")
    if speculative_config:
        num_scheduler_steps = 1  # speculative decoding runs one step per call
    args = dict(shape=shape_name, num_prompts=num_prompts, min_prompt=min_prompt, max_prompt=max_prompt, new=new,
                num_scheduler_steps=num_scheduler_steps, async_scheduling=async_scheduling, seed=seed)
    if speculative_config:
        args.update(speculative_config=speculative_config)
    if num_loras:
        args.update(num_loras=num_loras, lora_rank=lora_rank)
    if tensor_parallel_size > 1 or data_parallel_size > 1:
        args.update(tensor_parallel_size=tensor_parallel_size, data_parallel_size=data_parallel_size)
    if quantization:
        args.update(quantization=quantization)
    memory = {} if gpu_memory_utilization is None else {"gpu_memory_utilization": gpu_memory_utilization}
    args.update(memory)
    if batch_invariant:
        args.update(batch_invariant=True)
    if kernels != "auto":
        args.update(kernels=kernels)
    model = shape(shape_name)
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_prompt, max_prompt + 1, num_prompts)
    prompts = [rng.integers(0, model.vocab_size, n).tolist() for n in lengths]
    warmup = [rng.integers(0, model.vocab_size, min_prompt).tolist() for _ in range(WARMUP_REQUESTS)]
    peer_result = (
        hf_peer.run(dict(workload="throughput", config=hf_config(model), prompts=prompts, new=new, seed=seed))
        if peer else {"skipped": "--no-peer"}
    )
    lora_args = dict(enable_lora=True, max_loras=num_loras, max_lora_rank=lora_rank) if num_loras else {}
    llm = LLM(
        shape_name,
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=max_prompt + new,
        num_scheduler_steps=num_scheduler_steps,
        async_scheduling=async_scheduling,
        seed=seed,
        speculative_config=speculative_config,
        tensor_parallel_size=tensor_parallel_size,
        quantization=quantization,
        batch_invariant=batch_invariant,
        kernels=kernels,
        **memory,
        data_parallel_size=data_parallel_size,
        **lora_args,
    )
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [random_adapter(os.path.join(tmp, f"lora{i}"), model, lora_rank, seed + i) for i in range(num_loras)]
        loras = [LoRARequest(f"lora{i}", i + 1, path) for i, path in enumerate(adapters)]
        def spread(n: int) -> list[LoRARequest] | None:
            return [loras[i % num_loras] for i in range(n)] if loras else None

        llm.generate(warmup, params, use_tqdm=False, lora_request=spread(len(warmup)))
        per_request = spread(num_prompts)
        with jax.profiler.trace(trace_dir, profiler_options=_device_only()) if trace_dir else contextlib.nullcontext():
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, lora_request=per_request)
            elapsed = time.perf_counter() - start
    if failed := [out.error for out in outputs if out.error is not None]:
        raise RuntimeError(f"{len(failed)} of {num_prompts} W2 requests failed, e.g.: {failed[0]}")
    tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    result = {
        "workload": "W2 throughput",
        "device": jax.devices()[0].device_kind,
        "shape": shape_name,
        "dtype": llm.llm_engine.config.dtype,
        "args": args,
        "elapsed_s": elapsed,
        "prompt_tokens": int(lengths.sum()),
        "output_tokens": tokens,
        "tokens_per_s": tokens / elapsed,
        "startup": llm.llm_engine.startup,  # the engine's warm-up report (empty where it does not warm up)
        "spec_decoding": llm.llm_engine.stats().spec_decoding,
        "peer": peer_result,
    }
    if "skipped" not in peer_result:
        result["speedup_vs_peer"] = result["tokens_per_s"] / peer_result["tokens_per_s"]
    return result


def _device_only() -> jax.profiler.ProfileOptions:
    """The profiler's options without its Python tracer, which would slow the engine's host work
    many times over and so misstate the host's share of the run."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    return options


def random_adapter(path: str, model: ModelConfig, rank: int, seed: int) -> str:
    """A PEFT LoRA adapter of `rank` on every projection the model has (a Mixture-of-Experts model's
    attention), random weights (std 0.02), saved at `path`."""
    rng = np.random.default_rng(seed)
    parts = projection_parts(model)
    modules = {module: target for module, target in MODULES.items() if target[0] in parts}
    tensors = {}
    for layer in range(model.num_layers):
        for module, (name, part) in modules.items():
            width, out = parts[name][0], parts[name][1][part]
            block = "self_attn" if name in ("wqkv", "wo") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (0.02 * rng.standard_normal((rank, width))).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (0.02 * rng.standard_normal((out, rank))).astype(np.float32)
    os.makedirs(path)
    save_file(tensors, os.path.join(path, WEIGHTS_FILE))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(modules)}, f)
    return path


def summary(result: dict) -> str:
    """A few lines for people: ours, the peer and the ratio."""
    a = result["args"]
    lines = [
        f"W2 throughput: {result['shape']} ({result['dtype']}) on {result['device']}, {a['num_prompts']} requests, "
        f"prompts of {a['min_prompt']}-{a['max_prompt']} tokens, {a['new']} new tokens each",
        f"  jaxrunner: {result['tokens_per_s']:.0f} output tokens/s "
        f"({result['output_tokens']} in {result['elapsed_s']:.2f} s)",
    ]
    peer = result["peer"]
    figure = "{tokens_per_s:.0f} output tokens/s ({output_tokens} in {elapsed_s:.2f} s)"
    lines += hf_peer.summary_lines(peer, figure, result.get("speedup_vs_peer"), "ours / peer tokens/s")
    lines += spec_lines(result)
    return "\n".join(lines)
