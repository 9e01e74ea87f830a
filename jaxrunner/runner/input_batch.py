"""Host side of a step: the request table (slot per request, what the scheduler told us) and the
padded arrays one step sends to the device.

`RequestTable.apply` checks a SchedulerOutput completely before building the next table, so bad
input raises a ValueError and leaves the runner exactly as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from jaxrunner.checks import all_ints, is_int
from jaxrunner.config import ModelConfig, RunnerConfig
from jaxrunner.lora_request import LoRARequest
from jaxrunner.sampling import (
    RequestSampling,
    SamplerFlags,
    build_sampling_metadata,
    flag_variants,
    mask_words,
    prepare_request,
)
from jaxrunner.sampling_params import SamplingParams
from jaxrunner.runner.step import SampleInputs, TokenInputs
from jaxrunner.step_io import SchedulerOutput, decode_steps


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
            known = computed + 1 if is_relative(row, cfg) else row.num_tokens
            rows[rid] = replace(row, block_ids=block_ids, num_computed=computed, num_tokens=known)
        dirty = [n.req_id for n in sched.scheduled_new_reqs]
        dirty += [rid for rid, blocks in zip(cached.req_ids, cached.new_block_ids) if blocks and any(blocks)]
        return RequestTable(rows, tuple(free)), dirty

    def advance(self, computed: dict[str, int], sampled: dict[str, int]) -> RequestTable:
        """Progress once a step is dispatched: KV computed for `computed[rid]` more tokens, and
        `sampled[rid]` more tokens known (they exist on the device; the host needs no values)."""
        rows = dict(self.rows)
        for rid, n in computed.items():
            row = rows[rid]
            rows[rid] = replace(row, num_computed=row.num_computed + n, num_tokens=row.num_tokens + sampled.get(rid, 0))
        return RequestTable(rows, self.free_slots)

    def num_drafts(self, rid: str, sched: SchedulerOutput) -> int:
        return len(sched.scheduled_spec_decode_tokens.get(rid, ()))

    def decode_steps(self, rid: str, num_steps: int, max_model_len: int) -> int:
        row = self.rows[rid]
        return decode_steps(num_steps, row.num_tokens, row.num_tokens - row.prompt_len, row.sampling_params, max_model_len)


def is_relative(row: RequestRow, cfg: RunnerConfig) -> bool:
    """Whether the row's length is the device's to know: with speculative decoding, once the row
    has sampled tokens (a step keeps 1 to k + 1 of them). The host then holds an upper bound,
    the scheduler's (which assumes every draft in flight accepted)."""
    return cfg.speculative.enabled and row.num_tokens > len(row.prefill_token_ids)


def _check(table: RequestTable, sched: SchedulerOutput, cfg: RunnerConfig, vocab_size: int, num_groups: int) -> None:
    def bad(msg: str) -> None:
        raise ValueError(f"SchedulerOutput rejected: {msg}")

    _check_types(sched, bad)
    gone = (set(sched.finished_req_ids) | set(sched.preempted_req_ids)) & table.rows.keys()
    live = table.rows.keys() - gone
    new_ids = [n.req_id for n in sched.scheduled_new_reqs]
    cached = sched.scheduled_cached_reqs
    if len(set(new_ids)) != len(new_ids):
        bad(f"duplicate request ids among new requests: {sorted({r for r in new_ids if new_ids.count(r) > 1})}")
    if clash := set(new_ids) & live:
        bad(f"new requests {sorted(clash)} are already running (finish or preempt them first)")
    if len(set(cached.req_ids)) != len(cached.req_ids):
        bad("duplicate request ids among cached requests")
    if unknown := set(cached.req_ids) - live:
        bad(f"unknown request ids {sorted(unknown)}: cached requests must have been added as new requests")
    if not len(cached.req_ids) == len(cached.new_block_ids) == len(cached.num_computed_tokens):
        bad("scheduled_cached_reqs fields have different lengths")
    if len(live) + len(new_ids) > cfg.max_num_seqs:
        bad(f"{len(live) + len(new_ids)} live requests exceed max_num_seqs={cfg.max_num_seqs}")
    scheduled = set(new_ids) | set(cached.req_ids)
    if set(sched.num_scheduled_tokens) != scheduled:
        bad(
            "num_scheduled_tokens must name exactly the new and cached requests; "
            f"extra {sorted(set(sched.num_scheduled_tokens) - scheduled)}, missing {sorted(scheduled - set(sched.num_scheduled_tokens))}"
        )
    if sched.num_steps < 1:
        bad(f"num_steps must be at least 1, got {sched.num_steps}")
    _check_drafts(table, sched, cfg, vocab_size, scheduled, bad)
    _check_grammar(table, sched, cfg, bad)
    total = sum(sched.num_scheduled_tokens.values())
    if total != sched.total_num_scheduled_tokens:
        bad(f"total_num_scheduled_tokens={sched.total_num_scheduled_tokens} but the per-request counts sum to {total}")
    if total > cfg.max_num_batched_tokens:
        bad(f"{total} scheduled tokens exceed the largest bucket, max_num_batched_tokens={cfg.max_num_batched_tokens}")

    def check_request(rid: str, groups: list[list[int]], computed: int, known: int, prompt_len: int,
                      sp: SamplingParams) -> None:
        n = sched.num_scheduled_tokens[rid]
        if n < 1:
            bad(f"request {rid!r}: num_scheduled_tokens must be at least 1, got {n}")
        if known > cfg.max_model_len or computed + n > cfg.max_model_len:
            bad(f"request {rid!r} needs {max(known, computed + n)} tokens, longer than max_model_len={cfg.max_model_len}")
        if not 0 <= computed or computed + n > known:
            bad(f"request {rid!r}: num_computed_tokens={computed} + {n} scheduled exceeds the {known} known tokens")
        reach = computed + n  # tokens whose KV this call writes
        if sched.num_steps > 1:
            if n != 1 or computed + 1 != known:
                bad(f"multi-step decode (num_steps={sched.num_steps}) needs one-token decodes; request {rid!r} "
                    f"schedules {n} of its {known - computed} uncomputed tokens")
            if sp.prompt_logprobs is not None and computed < prompt_len:
                bad(f"request {rid!r} wants prompt logprobs: schedule its prompt with num_steps=1")
            reach = computed + decode_steps(sched.num_steps, known, known - prompt_len, sp, cfg.max_model_len)
        reach = min(reach + cfg.speculative.num_lookahead_tokens, cfg.max_model_len)
        for g, block_ids in enumerate(groups):
            of = f" of KV-cache group {g}" if num_groups > 1 else ""
            if outside := [b for b in block_ids if not 0 <= b < cfg.num_blocks]:
                bad(f"request {rid!r}: block ids {outside[:5]}{of} outside the cache (num_blocks={cfg.num_blocks})")
            if len(block_ids) > cfg.max_blocks_per_req:
                bad(f"request {rid!r}: {len(block_ids)} blocks{of} exceed max_model_len / block_size = "
                    f"{cfg.max_blocks_per_req}")
            if len(block_ids) * cfg.block_size < reach:
                ahead = " (with the draft model's lookahead)" if cfg.speculative.num_lookahead_tokens else ""
                bad(f"request {rid!r}: {len(block_ids)} blocks{of} cannot hold {reach} tokens{ahead} "
                    f"(block_size={cfg.block_size})")

    for new in sched.scheduled_new_reqs:
        tokens = new.all_prefill_token_ids
        if not tokens:
            bad(f"request {new.req_id!r} has an empty prompt")
        if outside := [t for t in tokens if not 0 <= t < vocab_size]:
            bad(f"request {new.req_id!r}: token ids {outside[:5]} outside the vocabulary (size {vocab_size})")
        if len(new.block_ids) != num_groups:
            bad(f"request {new.req_id!r}: block_ids must hold one list per KV-cache group ({num_groups}), "
                f"got {len(new.block_ids)}")
        check_request(new.req_id, list(map(list, new.block_ids)), new.num_computed_tokens, len(tokens),
                      len(new.prompt_token_ids), new.sampling_params)
    for rid, blocks, computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
        row = table.rows[rid]
        if blocks is not None and len(blocks) != num_groups:
            bad(f"request {rid!r}: new_block_ids must hold one list per KV-cache group ({num_groups}), "
                f"got {len(blocks)}")
        all_blocks = [list(old) + list(fresh) for old, fresh in zip(row.block_ids, blocks)] if blocks else row.block_ids
        known = computed + 1 + len(sched.scheduled_spec_decode_tokens.get(rid, ())) if is_relative(row, cfg) else row.num_tokens
        check_request(rid, all_blocks, computed, known, row.prompt_len, row.sampling_params)


def _check_drafts(
    table: RequestTable, sched: SchedulerOutput, cfg: RunnerConfig, vocab_size: int, scheduled: set[str],
    bad: Callable[[str], None],
) -> None:
    """Drafts go with decodes of requests that sampled before, 1 + len(drafts) tokens scheduled;
    -1 stands for the draft the device proposed there (vLLM's placeholder)."""
    drafts = sched.scheduled_spec_decode_tokens
    if not drafts:
        return
    k = cfg.speculative.num_speculative_tokens
    if not k:
        bad("scheduled_spec_decode_tokens given, but speculative decoding is off: set "
            "RunnerConfig.speculative (speculative_config) or leave it empty")
    if sched.num_steps != 1:
        bad("speculative decoding runs one step per call: num_steps must be 1 with scheduled_spec_decode_tokens")
    for rid, ids in drafts.items():
        if rid not in scheduled:
            bad(f"scheduled_spec_decode_tokens names {rid!r}, which is not scheduled")
        if not isinstance(ids, (list, tuple)) or not all_ints(ids):
            bad(f"request {rid!r}: draft tokens must be a list of integers, got {ids!r:.60}")
        if len(ids) > k:
            bad(f"request {rid!r}: {len(ids)} draft tokens exceed num_speculative_tokens={k}")
        if outside := [t for t in ids if not -1 <= t < vocab_size]:
            bad(f"request {rid!r}: draft token ids {outside[:5]} outside the vocabulary (size {vocab_size}; "
                "-1: the device's draft)")
        row = table.rows.get(rid)
        if row is None or not is_relative(row, cfg) or rid in sched.preempted_req_ids | sched.finished_req_ids:
            bad(f"request {rid!r} has no sampled token yet: drafts follow a request's decodes only")
        if sched.num_scheduled_tokens[rid] != 1 + len(ids):
            bad(f"request {rid!r}: a decode with {len(ids)} drafts schedules {1 + len(ids)} tokens, "
                f"not {sched.num_scheduled_tokens[rid]}")


def _check_grammar(
    table: RequestTable, sched: SchedulerOutput, cfg: RunnerConfig, bad: Callable[[str], None]
) -> None:
    """Masks go with requests that sample this step, and one step per call."""
    starts = sched.structured_output_request_ids
    if not starts:
        return
    if sched.num_steps != 1:
        bad("grammar masks need one step per call: num_steps must be 1 with structured outputs")
    new = {n.req_id: n for n in sched.scheduled_new_reqs}
    cached = dict(zip(sched.scheduled_cached_reqs.req_ids, sched.scheduled_cached_reqs.num_computed_tokens))
    for rid in starts:
        n = sched.num_scheduled_tokens.get(rid)
        if n is None:
            bad(f"structured_output_request_ids names {rid!r}, which is not scheduled")
        if rid in new:
            samples = new[rid].num_computed_tokens + n == len(new[rid].all_prefill_token_ids)
        else:
            row = table.rows[rid]
            samples = is_relative(row, cfg) or cached[rid] + n == row.num_tokens
        if not samples:
            bad(f"request {rid!r} has a grammar mask but samples no token this step (a prompt chunk before its last)")


def check_grammar_bitmask(sched: SchedulerOutput, masks: np.ndarray | None, vocab_size: int) -> None:
    """The masks of `sched`'s structured requests: 1 + len(drafts) rows each, of ceil(V / 32) int32."""
    def bad(msg: str) -> None:
        raise ValueError(f"grammar masks rejected: {msg}")

    starts = sched.structured_output_request_ids
    if not starts and masks is None:
        return
    if not starts or masks is None:
        bad("structured_output_request_ids and grammar_bitmask go together: give both or neither")
    width = mask_words(vocab_size)
    if not isinstance(masks, np.ndarray) or masks.dtype != np.int32 or masks.ndim != 2 or masks.shape[1] != width:
        shape = getattr(masks, "shape", None)
        bad(f"grammar_bitmask must be an int32 numpy array [rows, {width}] (ceil(vocab_size / 32) words per mask), "
            f"got {type(masks).__name__} {shape} {getattr(masks, 'dtype', '')}")
    for rid, start in starts.items():
        rows = 1 + len(sched.scheduled_spec_decode_tokens.get(rid, ()))
        if not is_int(start) or not 0 <= start <= masks.shape[0] - rows:
            bad(f"request {rid!r}: its {rows} grammar masks from row {start!r} do not fit grammar_bitmask's {masks.shape[0]} rows")


def write_grammar_rows(
    target: np.ndarray, order: list[str], sched: SchedulerOutput, masks: np.ndarray, masks_per_row: int
) -> None:
    """Spread the step's grammar masks over the batch rows of `target` (i32 [rows, masks_per_row * W],
    all -1 to start: every token allowed, for requests without a grammar and past a request's drafts)."""
    starts = sched.structured_output_request_ids
    rows = target[: len(order)].reshape(len(order), masks_per_row, masks.shape[1])
    for i, rid in enumerate(order):
        if rid in starts:
            n = 1 + len(sched.scheduled_spec_decode_tokens.get(rid, ()))
            rows[i, :n] = masks[starts[rid] : starts[rid] + n]


def _check_types(sched: SchedulerOutput, bad: Callable[[str], None]) -> None:
    """Counts, positions and ids must be ints: a float would be truncated, or fail deep in the step."""

    def ints(what: str, values: list) -> None:
        if not all_ints(values):
            bad(f"{what} must be integers, got {[v for v in values if not is_int(v)][:5]}")

    cached = sched.scheduled_cached_reqs
    ints("num_scheduled_tokens", list(sched.num_scheduled_tokens.values()))
    ints("total_num_scheduled_tokens and num_steps", [sched.total_num_scheduled_tokens, sched.num_steps])
    ints("num_computed_tokens", [n.num_computed_tokens for n in sched.scheduled_new_reqs] + list(cached.num_computed_tokens))
    def block_ids(what: str, groups: object) -> None:
        if not isinstance(groups, (tuple, list)) or not all(isinstance(g, (tuple, list)) for g in groups):
            bad(f"{what} must hold one list of block ids per KV-cache group, got {groups!r:.60}")
        ints(what, [b for group in groups for b in group])

    for new in sched.scheduled_new_reqs:
        if not isinstance(new.sampling_params, SamplingParams):
            bad(f"request {new.req_id!r}: sampling_params must be a SamplingParams, got {type(new.sampling_params).__name__}")
        if new.lora_request is not None and not isinstance(new.lora_request, LoRARequest):
            bad(f"request {new.req_id!r}: lora_request must be a LoRARequest, got {type(new.lora_request).__name__}")
        ints(f"request {new.req_id!r}: token ids", list(new.prompt_token_ids))
        if new.prefill_token_ids is not None:
            ints(f"request {new.req_id!r}: prefill token ids", list(new.prefill_token_ids))
        block_ids(f"request {new.req_id!r}: block_ids", new.block_ids)
    for rid, groups in zip(cached.req_ids, cached.new_block_ids):
        if groups is not None:
            block_ids(f"request {rid!r}: new_block_ids", groups)


def batch_order(sched: SchedulerOutput) -> list[str]:
    """Decodes first, then by ascending query length (vLLM's order; decode kernels want it)."""
    ids = [n.req_id for n in sched.scheduled_new_reqs] + list(sched.scheduled_cached_reqs.req_ids)
    return sorted(ids, key=lambda rid: sched.num_scheduled_tokens[rid])


def build_inputs(
    table: RequestTable,
    order: list[str],
    scheduled: dict[str, int],
    cfg: RunnerConfig,
    vocab_size: int,
    t_bucket: int,
    b_bucket: int,
    drafts: dict[str, list[int]] | None = None,
    grammar_bitmask: np.ndarray | None = None,
    lora_slots: dict[str, int] | None = None,
) -> tuple[TokenInputs, SampleInputs, SamplerFlags, set[str]]:
    """Padded arrays for one step, the sampler's static flags, and the requests that sample a token.
    `drafts`: the scheduled draft tokens per request (speculative decoding); `grammar_bitmask`: the
    rows' masks, or -1 (all allowed) of their shape until `write_grammar_rows` fills them;
    `lora_slots`: the LoRA slot value of each request with an adapter."""
    drafts, lora_slots = drafts or {}, lora_slots or {}
    r, s = cfg.max_num_seqs, cfg.max_num_seqs
    token_ids = np.full(t_bucket, -1, np.int32)
    token_rows = np.full(t_bucket, r, np.int32)
    positions = np.zeros(t_bucket, np.int32)
    qsl = np.zeros(s + 1, np.int32)
    seq_lens = np.zeros(s, np.int32)
    seq_rows = np.zeros(s, np.int32)
    commit_rows = np.full(b_bucket, r, np.int32)
    relative, seq_relative, num_drafts = np.zeros(t_bucket, bool), np.zeros(s, bool), np.zeros(s, np.int32)
    token_lora = np.zeros(t_bucket if cfg.lora.enabled else 0, np.int32)
    sample_positions = []
    sampled = set()
    start = 0
    for i, rid in enumerate(order):
        row, n = table.rows[rid], scheduled[rid]
        if is_relative(row, cfg):  # the last kept token and the drafts, at offsets from the device length
            ids = drafts.get(rid, [])
            token_ids[start + 1 : start + n] = ids
            positions[start : start + n] = np.arange(n, dtype=np.int32)
            relative[start : start + n] = seq_relative[i] = True
            num_drafts[i], end = len(ids), n
            sample_positions.append(row.prompt_len)  # a lower bound: min_tokens is then checked on the device
        else:
            end = row.num_computed + n
            from_host = row.prefill_token_ids[row.num_computed : end]  # the rest are sampled tokens, on the device
            token_ids[start : start + len(from_host)] = from_host
            positions[start : start + n] = np.arange(row.num_computed, end, dtype=np.int32)
            sample_positions.append(end)
        token_rows[start : start + n] = row.slot
        if rid in lora_slots:
            token_lora[start : start + n] = lora_slots[rid]
        start += n
        qsl[i + 1] = start
        seq_lens[i] = end
        seq_rows[i] = row.slot
        if is_relative(row, cfg) or end == row.num_tokens:
            sampled.add(rid)
            commit_rows[i] = row.slot
    qsl[len(order) + 1 :] = start
    tokens = TokenInputs(token_ids, token_rows, positions, qsl, seq_lens, seq_rows, np.int32(len(order)), relative,
                         seq_relative, num_drafts, token_lora)
    md, flags = build_sampling_metadata(
        [table.rows[rid].sampling for rid in order], sample_positions, b_bucket, cfg.sampler, vocab_size,
        flag_variants(cfg.sampler, vocab_size), grammar_bitmask, 1 + cfg.speculative.num_speculative_tokens,
    )
    md.positions[: len(order)][seq_relative[: len(order)]] = 0
    samples = SampleInputs(commit_rows, seq_rows[:b_bucket], md, seq_relative[:b_bucket].copy(), num_drafts[:b_bucket].copy())
    return tokens, samples, flags, sampled


def block_table_rows(table: RequestTable, req_ids: list[str], cfg: RunnerConfig, bucket: int) -> tuple[np.ndarray, np.ndarray]:
    """Slots and full block-table rows [groups, bucket, max_blocks] of the given requests, padded to
    `bucket` (padding slot is dropped)."""
    slots = np.full(bucket, cfg.max_num_seqs, np.int32)
    groups = len(table.rows[req_ids[0]].block_ids)
    data = np.zeros((groups, bucket, cfg.max_blocks_per_req), np.int32)
    for i, rid in enumerate(req_ids):
        row = table.rows[rid]
        slots[i] = row.slot
        for g, block_ids in enumerate(row.block_ids):
            data[g, i, : len(block_ids)] = block_ids
    return slots, data


def prefill_rows(table: RequestTable, req_ids: list[str], cfg: RunnerConfig, bucket: int) -> tuple[np.ndarray, np.ndarray]:
    """Slots and whole token rows [bucket, max_model_len] (each request's prefill tokens, zeros after)
    of the given requests, padded to `bucket` (padding slot is dropped)."""
    slots = np.full(bucket, cfg.max_num_seqs, np.int32)
    rows = np.zeros((bucket, cfg.max_model_len), np.int32)
    for i, rid in enumerate(req_ids):
        row = table.rows[rid]
        slots[i] = row.slot
        rows[i, : len(row.prefill_token_ids)] = row.prefill_token_ids
    return slots, rows
