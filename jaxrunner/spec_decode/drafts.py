"""Speculative decoding's rules on the host: which requests the device alone knows the length of,
how many tokens a step may keep, and what drafts a SchedulerOutput may carry.

Each decode step of a request verifies up to k drafts in one forward pass of 1 + k query tokens and
keeps 1 to 1 + k tokens, so once a request has sampled, the host no longer knows its length: its
positions are then relative to the row's device length (`is_relative`), and the host keeps an upper
bound, the scheduler's (which assumes every draft in flight accepted).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from jaxrunner.config import SpeculativeConfig
from jaxrunner.step_io import SchedulerOutput, reject


class Row(Protocol):
    """What these rules read of a request's row in the runner's table."""

    prefill_token_ids: tuple[int, ...]
    num_tokens: int
    relative: bool  # `is_relative` of the row, kept with it


def queries_per_decode(spec: SpeculativeConfig) -> int:
    """Query tokens of a decode and rows each request samples: the last kept token and k drafts."""
    return 1 + spec.num_speculative_tokens


def is_relative(spec: SpeculativeConfig, row: Row) -> bool:
    """Whether the row's length is the device's to know: with speculative decoding, once the row
    has sampled tokens."""
    return spec.enabled and row.num_tokens > len(row.prefill_token_ids)


def num_drafts(sched: SchedulerOutput, req_id: str) -> int:
    return len(sched.scheduled_spec_decode_tokens.get(req_id, ()))


def check_drafts(sched: SchedulerOutput, rows: Mapping[str, Row], k: int, vocab_size: int, scheduled: set[str]) -> None:
    """Drafts (lists of ints, as `SchedulerOutput` checks when made) go with decodes of requests
    that sampled before, 1 + len(drafts) tokens scheduled; -1 stands for the draft the device
    proposed there (vLLM's placeholder)."""
    drafts = sched.scheduled_spec_decode_tokens
    if not drafts:
        return
    if not k:
        reject("scheduled_spec_decode_tokens given, but speculative decoding is off: set "
               "RunnerConfig.speculative (speculative_config) or leave it empty")
    if sched.num_steps != 1:
        reject("speculative decoding runs one step per call: num_steps must be 1 with scheduled_spec_decode_tokens")
    for rid, ids in drafts.items():
        if rid not in scheduled:
            reject(f"scheduled_spec_decode_tokens names {rid!r}, which is not scheduled")
        if len(ids) > k:
            reject(f"request {rid!r}: {len(ids)} draft tokens exceed num_speculative_tokens={k}")
        if outside := [t for t in ids if not -1 <= t < vocab_size]:
            reject(f"request {rid!r}: draft token ids {outside[:5]} outside the vocabulary (size {vocab_size}; "
                   "-1: the device's draft)")
        row = rows.get(rid)
        if row is None or not row.relative or rid in sched.preempted_req_ids | sched.finished_req_ids:
            reject(f"request {rid!r} has no sampled token yet: drafts follow a request's decodes only")
        if sched.num_scheduled_tokens[rid] != 1 + len(ids):
            reject(f"request {rid!r}: a decode with {len(ids)} drafts schedules {1 + len(ids)} tokens, "
                   f"not {sched.num_scheduled_tokens[rid]}")
