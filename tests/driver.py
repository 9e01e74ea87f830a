"""Test-only drivers. `drive` feeds `Runner.step`: staggered arrivals, chunked prefill mixed with decodes,
preemption and resumption, and shuffled, non-contiguous block ids. Tests use it to run the runner in
several ways and compare the tokens; the engine's real scheduler lives in jaxrunner.engine.
`prompt_logits` runs the model itself over a paged cache to get logits at every prompt position.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import jax
import numpy as np

from jaxrunner import CachedRequestData, LoRARequest, NewRequestData, Runner, RunnerConfig, SamplingParams, SchedulerOutput
from jaxrunner.models.attention import AttentionMetadata, paged_attend
from jaxrunner.config import Kernels
from jaxrunner.models.llama import compute_logits, forward
from jaxrunner.runner.state import init_state
from jaxrunner.runner.step import matmul_precision


@dataclass
class _Req:
    prompt: list[int]
    params: SamplingParams
    arrival: int
    out: list[int] = field(default_factory=list)
    blocks: list[list[int]] = field(default_factory=list)  # per KV-cache group
    computed: int = 0
    running: bool = False


def drive(
    runner: Runner,
    prompts: list[list[int]],
    max_new: int,
    *,
    params: list[SamplingParams] | None = None,
    chunk: int | None = None,
    stagger: int = 0,
    preempt: dict[int, list[int]] | None = None,
    seed: int = 0,
    outputs: list | None = None,
    lora_request: LoRARequest | None = None,
) -> list[list[int]]:
    """Generate `max_new` tokens for each prompt; request i arrives at step i * stagger.

    `lora_request`: the adapter every request runs with (None: the base model). `chunk` caps the tokens a request gets per step (chunked prefill); `preempt` maps a step to the
    request indices preempted at its start (they resume as new requests with prompt + outputs).
    Every RunnerOutput is appended to `outputs` when given.
    """
    cfg = runner.config
    rng = np.random.default_rng(seed)
    free = [int(b) for b in rng.permutation(cfg.num_blocks)]
    params = params or [SamplingParams(temperature=0.0)] * len(prompts)
    reqs = {str(i): _Req(list(p), sp, i * stagger) for i, (p, sp) in enumerate(zip(prompts, params))}
    state = runner.init_state()
    groups = len(runner.model_config.kv_cache_groups)
    finished: set[str] = set()
    step = 0
    while any(len(r.out) < max_new for r in reqs.values()):
        preempted = set()
        for i in (preempt or {}).get(step, []):
            r = reqs[str(i)]
            if r.running and len(r.out) < max_new:
                free += sum(r.blocks, [])
                r.blocks, r.computed, r.running = [], 0, False
                preempted.add(str(i))
        new, cached, scheduled = [], CachedRequestData(), {}
        for rid, r in reqs.items():
            if r.arrival > step or len(r.out) >= max_new or rid in preempted:
                continue
            known = r.prompt + r.out
            n = min(len(known) - r.computed, chunk or len(known))
            r.blocks = r.blocks or [[] for _ in range(groups)]
            need = -(-(r.computed + n) // cfg.block_size) - len(r.blocks[0])
            fresh = tuple([free.pop() for _ in range(need)] for _ in range(groups))
            for blocks, more in zip(r.blocks, fresh):
                blocks += more
            if r.running:
                cached.req_ids.append(rid)
                cached.new_block_ids.append(fresh if need else None)
                cached.num_computed_tokens.append(r.computed)
            else:
                new.append(NewRequestData(rid, r.prompt, tuple(map(list, r.blocks)), r.computed, r.params,
                                          prefill_token_ids=known, lora_request=lora_request))
                r.running = True
            scheduled[rid] = n
        sched = SchedulerOutput(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            finished_req_ids=finished,
            preempted_req_ids=preempted,
        )
        state, out = runner.step(state, sched)
        if outputs is not None:
            outputs.append(out)
        finished = set()
        for rid, toks in zip(out.req_ids, out.sampled_token_ids):
            r = reqs[rid]
            r.computed += scheduled[rid]
            r.out += toks
            if len(r.out) >= max_new:
                free += sum(r.blocks, [])
                r.blocks, r.running = [], False
                finished.add(rid)
        step += 1
    runner.step(state, SchedulerOutput(finished_req_ids=finished))
    return [reqs[str(i)].out[:max_new] for i in range(len(prompts))]


@functools.partial(jax.jit, static_argnums=0, static_argnames="kv_scales")
def chunk_logits(cfg, params, kv, ids, pos, md, kv_scales=(1.0, 1.0)):
    with jax.default_matmul_precision(matmul_precision(params)):
        attend = tuple(paged_attend(cfg, group, Kernels.choose("auto"), kv_scales=kv_scales) for group in md)
        hidden, kv = forward(params, cfg, ids, pos, kv, attend)
        return compute_logits(params, cfg, hidden), kv


def prompt_logits(cfg, params, prompt: list[int], chunk: int, block_size: int = 8, kv_cache_dtype: str = "auto",
                  kv_scales: tuple[float, float] = (1.0, 1.0)) -> np.ndarray:
    """Logits at every prompt position, prefilling in chunks over shuffled pages (in `kv_cache_dtype`),
    each KV-cache group in pages of its own."""
    length = max(128, -(-len(prompt) // 128) * 128)
    groups = len(cfg.kv_cache_groups)
    rc = RunnerConfig(max_num_seqs=1, max_model_len=length, block_size=block_size,
                      num_blocks=max(64, groups * length // block_size), dtype=str(params["embed"].dtype),
                      kv_cache_dtype=kv_cache_dtype)
    kv = init_state(cfg, rc).kv
    pages = np.random.default_rng(len(prompt)).permutation(rc.num_blocks)[: groups * rc.max_blocks_per_req]
    pages = pages.reshape(groups, rc.max_blocks_per_req).astype(np.int32)
    out = []
    for start in range(0, len(prompt), chunk):
        ids = np.asarray(prompt[start : start + chunk], np.int32)
        pos = np.arange(start, start + len(ids), dtype=np.int32)
        md = tuple(AttentionMetadata(table[pos // block_size] * block_size + pos % block_size, np.array([0, len(ids)], np.int32),
                                     np.array([pos[-1] + 1], np.int32), table[None], np.int32(1)) for table in pages)
        logits, kv = chunk_logits(cfg, params, kv, ids, pos, md, kv_scales=kv_scales)
        out.append(np.asarray(logits))
    return np.concatenate(out)


def perplexity(llm, text: str | dict) -> float:
    """exp of the mean negative logprob of `text`'s tokens after the first (`text`: a string, or a
    prompt dict of token ids), from `llm`'s prompt logprobs."""
    out = llm.generate([text], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    logprobs = [next(iter(p.values())).logprob for p in out.prompt_logprobs[1:]]
    return math.exp(-sum(logprobs) / len(logprobs))
