"""Grammar masks on the host: which requests of a step carry them, and their rows in the sampler's
buffer.

A structured request's masks (one for its next token, then one after each of its drafts) arrive in
`SchedulerOutput.grammar_bitmask`'s layout, vLLM's: int32 [rows, ceil(vocab_size / 32)], request r's
from row `structured_output_request_ids[r]`. The sampler reads them per batch row instead,
`queries_per_decode` masks side by side (`SamplingMetadata.grammar_bitmask`): the step's buffer
starts all -1 (every token allowed: requests without a grammar, and rows past a request's drafts),
and `write_masks` spreads the scheduler's rows over it once they are filled, which may be while
the forward pass runs.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from jaxrunner.checks import is_int
from jaxrunner.sampling import mask_words
from jaxrunner.spec_decode.drafts import Row, num_drafts
from jaxrunner.step_io import SchedulerOutput, reject


def check_structured(sched: SchedulerOutput, rows: Mapping[str, Row]) -> None:
    """Masks go with requests that sample this step, and one step per call."""
    starts = sched.structured_output_request_ids
    if not starts:
        return
    if sched.num_steps != 1:
        reject("grammar masks need one step per call: num_steps must be 1 with structured outputs")
    new = {n.req_id: n for n in sched.scheduled_new_reqs}
    cached = dict(zip(sched.scheduled_cached_reqs.req_ids, sched.scheduled_cached_reqs.num_computed_tokens))
    for rid in starts:
        n = sched.num_scheduled_tokens.get(rid)
        if n is None:
            reject(f"structured_output_request_ids names {rid!r}, which is not scheduled")
        if rid in new:
            samples = new[rid].num_computed_tokens + n == len(new[rid].all_prefill_token_ids)
        else:
            row = rows[rid]
            samples = row.relative or cached[rid] + n == row.num_tokens
        if not samples:
            reject(f"request {rid!r} has a grammar mask but samples no token this step (a prompt chunk before its last)")


def check_masks(sched: SchedulerOutput, masks: np.ndarray | None, vocab_size: int) -> None:
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
        rows = 1 + num_drafts(sched, rid)
        if not is_int(start) or not 0 <= start <= masks.shape[0] - rows:
            bad(f"request {rid!r}: its {rows} grammar masks from row {start!r} do not fit grammar_bitmask's {masks.shape[0]} rows")


def all_allowed(sched: SchedulerOutput, num_rows: int, masks_per_row: int, vocab_size: int) -> np.ndarray | None:
    """A step's mask rows before the scheduler's arrive: every token allowed (None for a step
    without structured requests: the sampler then has no mask to apply)."""
    if not sched.structured_output_request_ids:
        return None
    return np.broadcast_to(np.int32(-1), (num_rows, masks_per_row * mask_words(vocab_size)))


def write_masks(
    target: np.ndarray, order: tuple[str, ...], sched: SchedulerOutput, masks: np.ndarray, masks_per_row: int
) -> None:
    """Spread the step's grammar masks over the batch rows of `target` (i32 [rows, masks_per_row * W])."""
    starts = sched.structured_output_request_ids
    rows = target[: len(order)].reshape(len(order), masks_per_row, masks.shape[1])
    for i, rid in enumerate(order):
        if rid in starts:
            n = 1 + num_drafts(sched, rid)
            rows[i, :n] = masks[starts[rid] : starts[rid] + n]
