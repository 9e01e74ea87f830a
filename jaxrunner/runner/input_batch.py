"""The padded arrays one step sends to the device, from the request table: every array's shape is
fixed by the step's token and request buckets, so each bucket is one compiled program."""

from __future__ import annotations

import bisect

import numpy as np

from jaxrunner.config import RunnerConfig
from jaxrunner.runner.request_table import RequestTable
from jaxrunner.runner.step import SampleInputs, TokenInputs
from jaxrunner.sampling import SamplerFlags, build_sampling_metadata, flag_variants
from jaxrunner.spec_decode.drafts import queries_per_decode
from jaxrunner.step_io import SchedulerOutput


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket that holds n."""
    return buckets[bisect.bisect_left(buckets, n)]


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
) -> tuple[TokenInputs, SampleInputs, SamplerFlags, set[str]]:
    """Padded arrays for one step, the sampler's static flags, and the requests that sample a token.
    `drafts`: the scheduled draft tokens per request (speculative decoding); `grammar_bitmask`: the
    rows' masks, or -1 (all allowed) of their shape until `grammar_masks.write_masks` fills them.
    The tokens' LoRA slots are all 0 (the base model) here: `plan` sets them."""
    drafts = drafts or {}
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
        if row.relative:  # the last kept token and the drafts, at offsets from the device length
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
        start += n
        qsl[i + 1] = start
        seq_lens[i] = end
        seq_rows[i] = row.slot
        if row.relative or end == row.num_tokens:
            sampled.add(rid)
            commit_rows[i] = row.slot
    qsl[len(order) + 1 :] = start
    tokens = TokenInputs(token_ids, token_rows, positions, qsl, seq_lens, seq_rows, np.int32(len(order)), relative,
                         seq_relative, num_drafts, token_lora)
    md, flags = build_sampling_metadata(
        [table.rows[rid].sampling for rid in order], sample_positions, b_bucket, cfg.sampler, vocab_size,
        flag_variants(cfg.sampler, vocab_size), grammar_bitmask, queries_per_decode(cfg.speculative),
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
