"""The runner's request table: a slot per request and what the scheduler told us of it.

`RequestTable.apply` checks a SchedulerOutput completely before building the next table, so bad
input raises a ValueError and leaves the runner exactly as it was.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from jaxrunner.config import ModelConfig, RunnerConfig, SpeculativeConfig
from jaxrunner.runner.grammar_masks import check_structured
from jaxrunner.sampling import RequestSampling, prepare_request
from jaxrunner.sampling_params import SamplingParams
from jaxrunner.spec_decode.drafts import check_drafts, is_relative, num_drafts
from jaxrunner.step_io import SchedulerOutput, decode_steps, reject


@dataclass(frozen=True)
class RequestRow:
    req_id: str
    slot: int
    prefill_token_ids: tuple[int, ...]  # prompt, plus earlier outputs for a resumed request
    prompt_len: int
    sampling_params: SamplingParams
    sampling: RequestSampling  # the parameters packed for the sampler, with the request's 64-bit seed
    block_ids: tuple[tuple[int, ...], ...]  # per KV-cache group
    num_computed: int  # tokens whose KV is in the cache
    num_tokens: int  # tokens known so far: prefill + sampled
    lora_id: int = 0  # its LoRA adapter's lora_int_id (0: the base model)
    relative: bool = False  # its length is the device's to know (`spec_decode.drafts.is_relative`)


@dataclass(frozen=True)
class RequestTable:
    rows: dict[str, RequestRow]
    free_slots: tuple[int, ...]

    @classmethod
    def empty(cls, max_num_seqs: int) -> RequestTable:
        return cls({}, tuple(range(max_num_seqs)))

    def apply(
        self, sched: SchedulerOutput, cfg: RunnerConfig, model: ModelConfig, rng: np.random.Generator
    ) -> tuple[RequestTable, list[str]]:
        """The table after `sched`, and the requests whose block-table rows changed."""
        _check(self, sched, cfg, model.vocab_size, len(model.kv_cache_groups))
        packed = [
            prepare_request(n.sampling_params, 0, len(n.prompt_token_ids), cfg.sampler, model.vocab_size,
                            model.eos_token_ids)
            for n in sched.scheduled_new_reqs
        ]
        gone = (set(sched.finished_req_ids) | set(sched.preempted_req_ids)) & self.rows.keys()
        rows = {rid: row for rid, row in self.rows.items() if rid not in gone}
        free = list(self.free_slots) + sorted(self.rows[rid].slot for rid in gone)
        for new, sampling in zip(sched.scheduled_new_reqs, packed):
            sp = new.sampling_params
            prefill = tuple(new.all_prefill_token_ids)
            seed = int(rng.integers(0, 2**63)) if sp.seed is None else sp.seed
            rows[new.req_id] = RequestRow(
                req_id=new.req_id,
                slot=free.pop(0),
                prefill_token_ids=prefill,
                prompt_len=len(new.prompt_token_ids),
                sampling_params=sp,
                sampling=replace(sampling, seed=seed),
                block_ids=tuple(map(tuple, new.block_ids)),
                num_computed=new.num_computed_tokens,
                num_tokens=len(prefill),
                lora_id=new.lora_request.lora_int_id if new.lora_request is not None else 0,
            )
        cached = sched.scheduled_cached_reqs
        for rid, blocks, computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            row = rows[rid]
            block_ids = tuple(old + tuple(fresh) for old, fresh in zip(row.block_ids, blocks)) if blocks else row.block_ids
            known = computed + 1 if row.relative else row.num_tokens
            rows[rid] = replace(row, block_ids=block_ids, num_computed=computed, num_tokens=known)
        dirty = [n.req_id for n in sched.scheduled_new_reqs]
        dirty += [rid for rid, blocks in zip(cached.req_ids, cached.new_block_ids) if blocks and any(blocks)]
        return RequestTable(rows, tuple(free)), dirty

    def advance(self, computed: dict[str, int], sampled: dict[str, int], spec: SpeculativeConfig) -> RequestTable:
        """Progress once a step is dispatched: KV computed for `computed[rid]` more tokens, and
        `sampled[rid]` more tokens known (they exist on the device; the host needs no values)."""
        rows = dict(self.rows)
        for rid, n in computed.items():
            row = replace(rows[rid], num_computed=rows[rid].num_computed + n,
                          num_tokens=rows[rid].num_tokens + sampled.get(rid, 0))
            rows[rid] = replace(row, relative=is_relative(spec, row))
        return RequestTable(rows, self.free_slots)


def _check(table: RequestTable, sched: SchedulerOutput, cfg: RunnerConfig, vocab_size: int, num_groups: int) -> None:
    gone = (set(sched.finished_req_ids) | set(sched.preempted_req_ids)) & table.rows.keys()
    live = table.rows.keys() - gone
    new_ids = [n.req_id for n in sched.scheduled_new_reqs]
    cached = sched.scheduled_cached_reqs
    if len(set(new_ids)) != len(new_ids):
        reject(f"duplicate request ids among new requests: {sorted({r for r in new_ids if new_ids.count(r) > 1})}")
    if clash := set(new_ids) & live:
        reject(f"new requests {sorted(clash)} are already running (finish or preempt them first)")
    if len(set(cached.req_ids)) != len(cached.req_ids):
        reject("duplicate request ids among cached requests")
    if unknown := set(cached.req_ids) - live:
        reject(f"unknown request ids {sorted(unknown)}: cached requests must have been added as new requests")
    if not len(cached.req_ids) == len(cached.new_block_ids) == len(cached.num_computed_tokens):
        reject("scheduled_cached_reqs fields have different lengths")
    if len(live) + len(new_ids) > cfg.max_num_seqs:
        reject(f"{len(live) + len(new_ids)} live requests exceed max_num_seqs={cfg.max_num_seqs}")
    scheduled = set(new_ids) | set(cached.req_ids)
    if set(sched.num_scheduled_tokens) != scheduled:
        reject(
            "num_scheduled_tokens must name exactly the new and cached requests; "
            f"extra {sorted(set(sched.num_scheduled_tokens) - scheduled)}, missing {sorted(scheduled - set(sched.num_scheduled_tokens))}"
        )
    if sched.num_steps < 1:
        reject(f"num_steps must be at least 1, got {sched.num_steps}")
    check_structured(sched, table.rows)
    check_drafts(sched, table.rows, cfg.speculative.num_speculative_tokens, vocab_size, scheduled)
    total = sum(sched.num_scheduled_tokens.values())
    if total != sched.total_num_scheduled_tokens:
        reject(f"total_num_scheduled_tokens={sched.total_num_scheduled_tokens} but the per-request counts sum to {total}")
    if total > cfg.max_num_batched_tokens:
        reject(f"{total} scheduled tokens exceed the largest bucket, max_num_batched_tokens={cfg.max_num_batched_tokens}")

    def check_request(rid: str, groups: list[list[int]], computed: int, known: int, prompt_len: int,
                      sp: SamplingParams) -> None:
        n = sched.num_scheduled_tokens[rid]
        if n < 1:
            reject(f"request {rid!r}: num_scheduled_tokens must be at least 1, got {n}")
        if known > cfg.max_model_len or computed + n > cfg.max_model_len:
            reject(f"request {rid!r} needs {max(known, computed + n)} tokens, longer than max_model_len={cfg.max_model_len}")
        if not 0 <= computed or computed + n > known:
            reject(f"request {rid!r}: num_computed_tokens={computed} + {n} scheduled exceeds the {known} known tokens")
        reach = computed + n  # tokens whose KV this call writes
        if sched.num_steps > 1:
            if n != 1 or computed + 1 != known:
                reject(f"multi-step decode (num_steps={sched.num_steps}) needs one-token decodes; request {rid!r} "
                    f"schedules {n} of its {known - computed} uncomputed tokens")
            if sp.prompt_logprobs is not None and computed < prompt_len:
                reject(f"request {rid!r} wants prompt logprobs: schedule its prompt with num_steps=1")
            reach = computed + decode_steps(sched.num_steps, known, known - prompt_len, sp, cfg.max_model_len)
        reach = min(reach + cfg.speculative.num_lookahead_tokens, cfg.max_model_len)
        for g, block_ids in enumerate(groups):
            of = f" of KV-cache group {g}" if num_groups > 1 else ""
            if outside := [b for b in block_ids if not 0 <= b < cfg.num_blocks]:
                reject(f"request {rid!r}: block ids {outside[:5]}{of} outside the cache (num_blocks={cfg.num_blocks})")
            if len(block_ids) > cfg.max_blocks_per_req:
                reject(f"request {rid!r}: {len(block_ids)} blocks{of} exceed max_model_len / block_size = "
                    f"{cfg.max_blocks_per_req}")
            if len(block_ids) * cfg.block_size < reach:
                ahead = " (with the draft model's lookahead)" if cfg.speculative.num_lookahead_tokens else ""
                reject(f"request {rid!r}: {len(block_ids)} blocks{of} cannot hold {reach} tokens{ahead} "
                    f"(block_size={cfg.block_size})")

    for new in sched.scheduled_new_reqs:
        tokens = new.all_prefill_token_ids
        if not tokens:
            reject(f"request {new.req_id!r} has an empty prompt")
        if outside := [t for t in tokens if not 0 <= t < vocab_size]:
            reject(f"request {new.req_id!r}: token ids {outside[:5]} outside the vocabulary (size {vocab_size})")
        if len(new.block_ids) != num_groups:
            reject(f"request {new.req_id!r}: block_ids must hold one list per KV-cache group ({num_groups}), "
                f"got {len(new.block_ids)}")
        check_request(new.req_id, list(map(list, new.block_ids)), new.num_computed_tokens, len(tokens),
                      len(new.prompt_token_ids), new.sampling_params)
    for rid, blocks, computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
        row = table.rows[rid]
        if blocks is not None and len(blocks) != num_groups:
            reject(f"request {rid!r}: new_block_ids must hold one list per KV-cache group ({num_groups}), "
                f"got {len(blocks)}")
        all_blocks = [list(old) + list(fresh) for old, fresh in zip(row.block_ids, blocks)] if blocks else row.block_ids
        known = computed + 1 + num_drafts(sched, rid) if row.relative else row.num_tokens
        check_request(rid, all_blocks, computed, known, row.prompt_len, row.sampling_params)

