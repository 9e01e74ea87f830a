"""The host half of a step, as a value: `prepare` turns the request table and a SchedulerOutput into
the next table and a `StepPlan`, everything the step's device calls need.

Nothing the runner holds changes while a plan is made, so a SchedulerOutput that fails a check
(a ValueError naming the problem) leaves the runner exactly as it was; the one exception is the
LoRA registry, which parses new adapters and gives the step's adapters their device slots, once
every check has passed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from jaxrunner.lora.adapters import Adapter, Adapters
from jaxrunner.runner.context import Context
from jaxrunner.runner.grammar_masks import all_allowed
from jaxrunner.runner.input_batch import batch_order, block_table_rows, bucket, build_inputs, prefill_rows
from jaxrunner.runner.request_table import RequestTable
from jaxrunner.runner.step import SampleInputs, TokenInputs
from jaxrunner.sampling import NO_LOGPROBS, PromptScoring, SamplerFlags, mask_words, prompt_scoring
from jaxrunner.sampling_params import SamplingParams
from jaxrunner.spec_decode.drafts import num_drafts
from jaxrunner.step_io import NewRequestData, SchedulerOutput, decode_steps


@dataclass(frozen=True)
class RowWrites:
    """Whole rows copied into a device table before the step runs: the requests' slots, padded to a
    request bucket with max_num_seqs (a write the program drops), and their rows."""

    slots: np.ndarray
    rows: np.ndarray


@dataclass(frozen=True)
class StepPlan:
    """One scheduled step, ready for the device. `steps[rid]`: the most tokens a request that
    samples keeps from the step (1 + its drafts; a multi-step call's rounds); `rounds`: a multi-step
    call's rounds per batch row ([0] for a single step)."""

    sched: SchedulerOutput
    order: tuple[str, ...]  # the batch's requests, in the order of its rows
    steps: dict[str, int]
    num_top: dict[str, int]  # the top logprobs each request asked for (-1: none)
    tokens: TokenInputs
    samples: SampleInputs
    flags: SamplerFlags
    uniform_decode: bool
    rounds: np.ndarray
    block_rows: RowWrites | None  # requests whose block-table rows changed
    token_rows: RowWrites | None  # new requests whose prefix came from the prefix cache
    lora_writes: tuple[tuple[int, Adapter], ...]  # (device slot, adapter) to load first
    scoring: tuple[PromptScoring, ...]  # rows of the step that score prompt tokens


def prepare(
    table: RequestTable, sched: SchedulerOutput, ctx: Context, rng: np.random.Generator, adapters: Adapters
) -> tuple[RequestTable, StepPlan | None]:
    """The table once `sched` is dispatched, and its plan (None for a step that schedules nothing).
    `rng` draws the seeds of new requests without one."""
    cfg, model = ctx.config, ctx.model
    table, dirty = table.apply(sched, cfg, model, rng)
    order = tuple(batch_order(sched))
    if not order:
        return table, None

    scheduled = sched.num_scheduled_tokens
    b_bucket = bucket(len(order), cfg.request_buckets)
    t_bucket = bucket(sched.total_num_scheduled_tokens, cfg.token_buckets)
    uniform_decode = ctx.uniform_decode(scheduled)
    masks = all_allowed(sched, len(order), ctx.queries_per_decode, model.vocab_size)
    tokens, samples, flags, sampled = build_inputs(table, list(order), scheduled, cfg, model.vocab_size, t_bucket,
                                                   b_bucket, sched.scheduled_spec_decode_tokens, masks)
    hits = [n.req_id for n in sched.scheduled_new_reqs if n.num_computed_tokens]
    block_rows, token_rows = _rows(block_table_rows, table, dirty, ctx), _rows(prefill_rows, table, hits, ctx)
    scoring = _scoring(table, order, scheduled) if sched.num_steps == 1 else ()
    tokens, lora_writes = _lora(adapters, sched, table, order, tokens, cfg.max_num_seqs)
    rounds = np.zeros(b_bucket if sched.num_steps > 1 else 0, np.int32)
    if sched.num_steps == 1:
        steps = {rid: 1 + num_drafts(sched, rid) for rid in sampled}
        computed = scheduled
    else:
        rows = [table.rows[rid] for rid in order]
        steps = {r.req_id: decode_steps(sched.num_steps, r.num_tokens, r.num_tokens - r.prompt_len, r.sampling_params,
                                        cfg.max_model_len) for r in rows}
        rounds[: len(order)] = [steps[rid] for rid in order]
        computed = steps
    plan = StepPlan(
        sched=sched,
        order=order,
        steps=steps,
        num_top={rid: table.rows[rid].sampling.num_logprobs for rid in order},
        tokens=tokens,
        samples=samples,
        flags=flags,
        uniform_decode=uniform_decode,
        rounds=rounds,
        block_rows=block_rows,
        token_rows=token_rows,
        lora_writes=lora_writes,
        scoring=scoring,
    )
    return table.advance(computed, steps, cfg.speculative), plan


def _lora(
    adapters: Adapters, sched: SchedulerOutput, table: RequestTable, order: tuple[str, ...], tokens: TokenInputs,
    max_num_seqs: int,
) -> tuple[TokenInputs, tuple[tuple[int, Adapter], ...]]:
    """Make the step's adapters resident (new ones read and checked first): the tokens then carry
    their requests' slot values (0: the base model), and the plan the slot writes that takes."""
    for new in sched.scheduled_new_reqs:
        if new.lora_request is not None:
            adapters.add(new.lora_request)
    lora_ids = {table.rows[rid].lora_id for rid in order} - {0}
    if not lora_ids:
        return tokens, ()
    values, writes = adapters.activate(lora_ids)
    by_slot = np.zeros(max_num_seqs + 1, np.int32)  # by table slot; the last is padding's
    for rid in order:
        by_slot[table.rows[rid].slot] = values.get(table.rows[rid].lora_id, 0)
    return dataclasses.replace(tokens, lora_slots=by_slot[tokens.token_rows]), tuple(writes)


def _rows(make, table: RequestTable, req_ids: list[str], ctx: Context) -> RowWrites | None:
    if not req_ids:
        return None
    return RowWrites(*make(table, req_ids, ctx.config, bucket(len(req_ids), ctx.config.request_buckets)))


def _scoring(table: RequestTable, order: tuple[str, ...], scheduled: dict[str, int]) -> tuple[PromptScoring, ...]:
    """The rows of the step's tokens that score prompt tokens, per request that wants prompt logprobs."""
    found, start = [], 0
    for rid in order:
        row = table.rows[rid]
        num_top = row.sampling_params.prompt_logprobs
        if num_top is not None:
            scoring = prompt_scoring(rid, row.prefill_token_ids, row.prompt_len, row.num_computed, scheduled[rid],
                                     start, num_top)
            if scoring is not None:
                found.append(scoring)
        start += scheduled[rid]
    return tuple(found)


def warmup_schedules(ctx: Context) -> list[SchedulerOutput]:
    """Synthetic schedules that reach every program variant a runner can ask for, each for an empty
    request table: each request bucket with each sampler variant (the new requests past a
    prefix-cache hit, so the row writes come too; a structured variant with every token allowed),
    each token bucket in the backbone's general and decode forms, and each multi-step decode batch.
    Their requests share the blocks from 0 on, holding nothing a served request could read, and
    each only the blocks its tokens reach: a block table row is as wide either way, and checking
    and copying every request's full row of ids took most of the time these plans take."""
    cfg = ctx.config
    groups = len(ctx.model.kv_cache_groups)

    def blocks(n: int, num_steps: int) -> list[int]:
        reach = min(n + num_steps + cfg.speculative.num_lookahead_tokens, cfg.max_model_len)
        return [b % cfg.num_blocks for b in range(math.ceil(reach / cfg.block_size))]

    def schedule(lengths: list[int], params: SamplingParams = SamplingParams(), computed: int = 0,
                 num_steps: int = 1, structured: bool = False) -> SchedulerOutput:
        new = [NewRequestData(f"warmup-{i}", [1] * n, (blocks(n, num_steps),) * groups, computed, params)
               for i, n in enumerate(lengths)]
        scheduled = {r.req_id: n - computed for r, n in zip(new, lengths)}
        masks = np.full((len(new), mask_words(ctx.model.vocab_size)), -1, np.int32) if structured else None
        return SchedulerOutput(new, num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
                               num_steps=num_steps, grammar_bitmask=masks,
                               structured_output_request_ids={r.req_id: i for i, r in enumerate(new)} if structured else {})

    schedules = []
    largest_decode = min(cfg.max_num_seqs * ctx.queries_per_decode, cfg.max_num_batched_tokens)
    for t in reversed(cfg.token_buckets):  # the largest first: they compile slowest
        for decode in ctx.forward_forms(t):
            size = ctx.queries_per_decode if decode else cfg.max_model_len
            total = min(t, largest_decode) if decode else t
            lengths = [size] * (total // size) + [total % size] * (total % size > 0)
            if len(lengths) <= cfg.max_num_seqs:  # else no batch lands in this bucket
                schedules.append(schedule(lengths))
    if cfg.num_scheduler_steps > 1:
        pairs = {}
        for n in range(1, min(cfg.max_num_seqs, cfg.max_num_batched_tokens) + 1):
            pairs.setdefault((bucket(n, cfg.token_buckets), bucket(n, cfg.request_buckets)), n)
        for n in sorted(pairs.values(), reverse=True):
            for flags in filter(ctx.loops, ctx.sampler_variants):
                schedules.append(schedule([1] * n, _sampling_params(flags), num_steps=cfg.num_scheduler_steps))
    for b in reversed(cfg.request_buckets):
        for flags in ctx.sampler_variants:
            schedules.append(schedule([2] * b, _sampling_params(flags), computed=1, structured=flags.grammar))
    return schedules


def warmup_plans(ctx: Context) -> list[StepPlan]:
    """The plans of `warmup_schedules`, each prepared as a served step's is: warm-up compiles the
    programs these call, so what it compiles and what serving runs come from one function, `prepare`."""
    adapters = Adapters(ctx.model, ctx.config.lora)
    return [prepare(RequestTable.empty(ctx.config.max_num_seqs), sched, ctx, np.random.default_rng(0), adapters)[1]
            for sched in warmup_schedules(ctx)]


def bucket_tiers(ctx: Context) -> list[Context]:
    """The contexts a background warm-up serves with as its programs arrive: the first with only
    the largest token and request buckets (any batch pads up to them), each next with one more
    bucket of each axis (the next smaller), the last `ctx` itself. A tier's warm-up plans call its
    programs and those of the tiers before it."""
    cfg = ctx.config
    tokens, requests = cfg.token_buckets, cfg.request_buckets
    tiers = [dataclasses.replace(ctx, config=dataclasses.replace(
        cfg, token_buckets=tokens[-min(i, len(tokens)):], request_buckets=requests[-min(i, len(requests)):]))
        for i in range(1, max(len(tokens), len(requests)))]
    return [*tiers, ctx]


def _sampling_params(flags: SamplerFlags) -> SamplingParams:
    """Parameters whose batch is promoted to `flags`: the variants are plain, truncation and
    everything, each without and with logprobs (a variant's grammar comes from the schedule)."""
    features = dict(repetition_penalty=1.1) if flags.penalties else dict(top_k=2) if flags.top_k_top_p else {}
    return SamplingParams(temperature=0.0, logprobs=None if flags.num_logprobs == NO_LOGPROBS else 0, **features)
