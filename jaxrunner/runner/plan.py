"""The host half of a step, as a value: `prepare` turns the request table and a SchedulerOutput into
the next table and a `StepPlan`, everything the step's device calls need.

Nothing the runner holds changes while a plan is made, so a SchedulerOutput that fails a check
(a ValueError naming the problem) leaves the runner exactly as it was; the one exception is the
LoRA registry, which parses new adapters and gives the step's adapters their device slots, once
every check has passed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxrunner.lora.adapters import Adapter, Adapters
from jaxrunner.runner.context import Context
from jaxrunner.runner.grammar_masks import all_allowed
from jaxrunner.runner.input_batch import batch_order, block_table_rows, bucket, build_inputs, prefill_rows
from jaxrunner.runner.request_table import RequestTable
from jaxrunner.runner.step import SampleInputs, TokenInputs
from jaxrunner.sampling import PromptScoring, SamplerFlags, prompt_scoring
from jaxrunner.spec_decode.drafts import num_drafts
from jaxrunner.step_io import SchedulerOutput, reject


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
    for new in sched.scheduled_new_reqs:
        if new.lora_request is not None:
            adapters.add(new.lora_request)
    table, dirty = table.apply(sched, cfg, model, rng)
    order = tuple(batch_order(sched))
    lora_ids = {table.rows[rid].lora_id for rid in order} - {0}
    if len(lora_ids) > cfg.lora.max_loras:
        reject(f"the step uses {len(lora_ids)} LoRA adapters, more than max_loras={cfg.lora.max_loras}")
    if not order:
        return table, None

    scheduled = sched.num_scheduled_tokens
    b_bucket = bucket(len(order), cfg.request_buckets)
    t_bucket = bucket(sched.total_num_scheduled_tokens, cfg.token_buckets)
    slot_values, writes = adapters.activate(lora_ids) if lora_ids else ({}, [])
    lora_slots = {rid: slot_values[table.rows[rid].lora_id] for rid in order if table.rows[rid].lora_id}
    masks = all_allowed(sched, len(order), ctx.queries_per_decode, model.vocab_size)
    tokens, samples, flags, sampled = build_inputs(table, list(order), scheduled, cfg, model.vocab_size, t_bucket,
                                                   b_bucket, sched.scheduled_spec_decode_tokens, masks, lora_slots)
    hits = [n.req_id for n in sched.scheduled_new_reqs if n.num_computed_tokens]
    rounds = np.zeros(b_bucket if sched.num_steps > 1 else 0, np.int32)
    if sched.num_steps == 1:
        steps = {rid: 1 + num_drafts(sched, rid) for rid in sampled}
        scoring = _scoring(table, order, scheduled)
        computed = scheduled
    else:
        steps = {rid: table.decode_steps(rid, sched.num_steps, cfg.max_model_len) for rid in order}
        rounds[: len(order)] = [steps[rid] for rid in order]
        scoring, computed = (), steps
    plan = StepPlan(
        sched=sched,
        order=order,
        steps=steps,
        num_top={rid: table.rows[rid].sampling.num_logprobs for rid in order},
        tokens=tokens,
        samples=samples,
        flags=flags,
        uniform_decode=ctx.uniform_decode(scheduled),
        rounds=rounds,
        block_rows=_rows(block_table_rows, table, dirty, ctx),
        token_rows=_rows(prefill_rows, table, hits, ctx),
        lora_writes=tuple(writes),
        scoring=scoring,
    )
    return table.advance(computed, steps, cfg.speculative), plan


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
