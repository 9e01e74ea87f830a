"""`jaxrunner bench latency`, workload W1 (docs/design.md): batch 1, a 128-token prompt, 256 greedy new
tokens, random weights in the Llama-3-8B shape; ms per decode step through the whole engine
(scheduling, host work, dispatch, the tokens' copy back), against the floor of reading every weight
once per step, and against Hugging Face transformers in the same invocation when it can run.

With speculative decoding a step brings back several tokens, and the figure is ms per output token.
`oracle=k` measures the mechanics' upper bound: k drafts a step that are always right, replayed
from the target's own greedy output of the same prompt (an untimed generation before each timed one).
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np
from tqdm import tqdm

from jaxrunner.bench import hf_peer
from jaxrunner.bench.floors import COPY_BANDWIDTH, weight_bytes_per_step
from jaxrunner.config import ModelConfig
from jaxrunner.engine.engine import LLMEngine
from jaxrunner.engine.llm import LLM
from jaxrunner.engine.request import Request
from jaxrunner.engine.scheduler import SpecDecodingStats
from jaxrunner.checkpoints.dummy import shape
from jaxrunner.sampling_params import SamplingParams

ORACLE_ROUNDS = 3  # untimed generations that find the oracle's answer

MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


def hf_config(model: ModelConfig) -> dict:
    """The Hugging Face config.json of a model shape, so the transformers peer builds the same model."""
    rope = {"rope_type": "default", "rope_theta": model.rope_theta}
    if model.rope_scaling is not None:
        s = model.rope_scaling
        rope.update(
            rope_type="llama3", factor=s.factor, low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor, original_max_position_embeddings=s.original_max_position_embeddings,
        )
    config = {
        "architectures": [model.architecture],
        "model_type": MODEL_TYPES[model.architecture],
        "vocab_size": model.vocab_size,
        "hidden_size": model.hidden_size,
        "intermediate_size": model.intermediate_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "rms_norm_eps": model.rms_norm_eps,
        "rope_parameters": rope,
        "max_position_embeddings": model.max_position_embeddings,
        "tie_word_embeddings": model.tie_word_embeddings,
        "attention_bias": model.qkv_bias,
        "bos_token_id": model.bos_token_id,
        "eos_token_id": list(model.eos_token_ids),
    }
    if model.sliding_window is not None:
        config.update(sliding_window=model.sliding_window, use_sliding_window=True)
    if model.num_experts:  # every layer's MLP sparse (Qwen3-MoE's names)
        config.update(num_experts=model.num_experts, num_experts_per_tok=model.num_experts_per_tok,
                      moe_intermediate_size=model.intermediate_size, norm_topk_prob=model.norm_topk_prob)
    return config


def run(
    shape_name: str = "llama3-8b",
    prompt: int = 128,
    new: int = 256,
    iters: int = 3,
    num_scheduler_steps: int = 8,
    async_scheduling: bool = True,
    seed: int = 0,
    peer: bool = True,
    speculative_config: dict | None = None,
    oracle: int = 0,
    tensor_parallel_size: int = 1,
    quantization: str | None = None,
    gpu_memory_utilization: float | None = None,
    batch_invariant: bool = False,
    kernels: str = "auto",
) -> dict:
    """One warm-up generation (every graph compiled), then `iters` timed ones, each with a fresh
    random prompt; the peer runs first, in its own process, on the same prompts."""
    if oracle:
        speculative_config = {"method": "ngram", "num_speculative_tokens": oracle}
    if speculative_config:
        num_scheduler_steps = 1  # speculative decoding runs one step per call
    if prompt < 1 or new < 2 or iters < 1:
        raise ValueError(f"need prompt >= 1, new >= 2 (ms per step divides by new - 1) and iters >= 1; "
                         f"got prompt={prompt}, new={new}, iters={iters}")
    args = dict(shape=shape_name, prompt=prompt, new=new, iters=iters, num_scheduler_steps=num_scheduler_steps,
                async_scheduling=async_scheduling, seed=seed)
    if speculative_config:
        args.update(speculative_config=speculative_config, oracle=oracle)
    if tensor_parallel_size > 1:
        args.update(tensor_parallel_size=tensor_parallel_size)
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
    prompts = [rng.integers(0, model.vocab_size, prompt).tolist() for _ in range(iters + 1)]
    peer_result = (
        hf_peer.run(dict(workload="latency", config=hf_config(model), prompts=prompts, new=new, seed=seed))
        if peer else {"skipped": "--no-peer"}
    )
    llm = LLM(
        shape_name,
        load_format="dummy",
        skip_tokenizer_init=True,
        max_num_seqs=1,
        max_model_len=prompt + new,
        max_num_batched_tokens=max(prompt, 16),
        enable_prefix_caching=False,  # every timed generation computes its prompt
        num_scheduler_steps=num_scheduler_steps,
        async_scheduling=async_scheduling,
        seed=seed,
        speculative_config=speculative_config,
        tensor_parallel_size=tensor_parallel_size,
        quantization=quantization,
        batch_invariant=batch_invariant,
        kernels=kernels,
        **memory,
    )
    engine = llm.llm_engine
    bar = tqdm(prompts, desc="W1 latency (warm-up + runs)")
    runs, timed = [], SpecDecodingStats()  # the drafts of the timed generations only
    for i, p in enumerate(bar):
        engine.scheduler.spec_stats = SpecDecodingStats()
        if oracle:  # the answer, refined by replaying it: a draft can move the last bits of bf16 logits
            engine.scheduler.proposer = None
            for j in range(ORACLE_ROUNDS):
                answer = _generate(engine, f"w1-{i}-answer-{j}", p, new)[2]
                engine.scheduler.proposer = Oracle(answer, len(p))
        if i:
            engine.scheduler.spec_stats = timed
        runs.append(_generate(engine, f"w1-{i}", p, new))
    engine.scheduler.proposer = None
    ttft_ms = [first * 1e3 for first, _, _ in runs[1:]]
    step_ms = [step * 1e3 for _, step, _ in runs[1:]]
    ours = statistics.median(step_ms)
    floor = weight_bytes_per_step(engine.runner.params, 1, engine.runner.model_config.num_experts_per_tok) / COPY_BANDWIDTH * 1e3
    result = {
        "workload": "W1 latency",
        "device": jax.devices()[0].device_kind,
        "shape": shape_name,
        "dtype": engine.config.dtype,
        "args": args,
        "ttft_ms": statistics.median(ttft_ms),
        "ttft_ms_all": ttft_ms,
        "decode_ms_per_step": ours,
        "decode_ms_per_step_all": step_ms,
        "floor_ms": floor,
        "fraction_of_floor": floor / ours,
        "startup": engine.startup,  # the engine's warm-up report (empty where it does not warm up)
        "spec_decoding": timed.as_dict() if speculative_config else {},
        "peer": peer_result,
    }
    if "skipped" not in peer_result:
        result["speedup_vs_peer"] = peer_result["decode_ms_per_step"] / ours
    return result


class Oracle:
    """A host proposer that replays a known answer: the drafts for a request are the answer's tokens
    after the ones it has (counting those in flight, which are right when every draft is)."""

    def __init__(self, answer: list[int], prompt_len: int) -> None:
        self.answer, self.prompt_len = answer, prompt_len

    def __call__(self, request: Request, num_drafts: int) -> list[int]:
        start = request.num_expected_tokens - self.prompt_len
        drafts = self.answer[start : start + num_drafts]
        return drafts + [-1] * (num_drafts - len(drafts))


def _generate(engine: LLMEngine, request_id: str, prompt: list[int], new: int) -> tuple[float, float, list[int]]:
    """Seconds from queuing one greedy request to its first token, and per decode step after it:
    (last token - first token) / (new - 1), which holds however many tokens each step brings back;
    and the tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    first = final = None
    while final is None:
        for out in engine.step():
            if out.error is not None:
                raise RuntimeError(f"the W1 request failed: {out.error}")
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter()
            if out.finished:
                final = out
    end = time.perf_counter()
    if len(final.outputs[0].token_ids) != new:
        raise RuntimeError(f"the W1 request returned {len(final.outputs[0].token_ids)} tokens, not {new}")
    return first - start, (end - first) / (new - 1), list(final.outputs[0].token_ids)


def summary(result: dict) -> str:
    """A few lines for people: ours, the floor, the peer and the ratio."""
    a = result["args"]
    lines = [
        f"W1 latency: {result['shape']} ({result['dtype']}) on {result['device']}, batch 1, "
        f"{a['prompt']}-token prompt, {a['new']} new tokens, median of {a['iters']}",
        f"  jaxrunner: {result['decode_ms_per_step']:.3f} ms per decode step, TTFT {result['ttft_ms']:.1f} ms; "
        f"floor {result['floor_ms']:.3f} ms ({result['fraction_of_floor']:.0%} of it)",
    ]
    peer = result["peer"]
    figure = "{decode_ms_per_step:.3f} ms per decode step, TTFT {ttft_ms:.1f} ms"
    lines += hf_peer.summary_lines(peer, figure, result.get("speedup_vs_peer"), "peer ms / ours")
    lines += spec_lines(result)
    return "\n".join(lines)


def spec_lines(result: dict) -> list[str]:
    """The speculative-decoding counters of a run, if it had them."""
    spec = result.get("spec_decoding")
    if not spec:
        return []
    per_position = ", ".join(f"{rate:.2f}" for rate in spec["acceptance_rate_per_position"])
    return [f"  speculative decoding: {spec['num_draft_tokens']} drafts, {spec['acceptance_rate']:.1%} accepted "
            f"(per position {per_position}), {spec['mean_acceptance_length']:.2f} tokens per decode"]
