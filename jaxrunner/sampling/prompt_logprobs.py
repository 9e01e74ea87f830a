"""Prompt logprobs on the host: which of a step's rows score which prompt tokens, and the chunks kept
until a prompt is complete (vLLM semantics).

The logits at position p score prompt token p + 1, so a prompt of length P yields P - 1 rows, and
they come from the backbone's hidden states of the step's own tokens. A request prefilled in chunks
computes its rows chunk by chunk (`prompt_logprob_positions`), a `PromptLogprobsBuffer` keeps them,
and they are emitted once, in the step that completes the prompt. A request resumed after
preemption (its prefill holds generated tokens too) emitted them before it was preempted, so it
computes none. The device half is `compute_logprobs` over the rows' logits, a fixed chunk of rows
per call (`PROMPT_LOGPROBS_CHUNK`), which bounds the [rows, vocab] logits of long prompts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from jaxrunner.step_io import LogprobsArrays

PROMPT_LOGPROBS_CHUNK = 256

# One chunk of rows and their target tokens -> (values, token ids, ranks), computed on the device.
ScoreChunk = Callable[[np.ndarray, np.ndarray], tuple]


@dataclass(frozen=True)
class PromptScoring:
    """One request's share of a step: its `rows` among the step's tokens score `targets`."""

    req_id: str
    rows: tuple[int, ...]
    targets: tuple[int, ...]
    num_top: int  # the top logprobs it asked for (-1: the whole vocabulary)
    completes: bool  # the step finishes its prompt


def prompt_logprob_positions(prompt_len: int, prefill_len: int, num_computed: int, num_scheduled: int) -> range:
    """Positions of this step's chunk whose logits score a prompt token (position p scores p + 1).

    Empty for a request resumed after preemption (prefill_len > prompt_len).
    """
    if prefill_len > prompt_len:
        return range(0)
    return range(num_computed, max(num_computed, min(num_computed + num_scheduled, prompt_len - 1)))


def prompt_scoring(
    req_id: str, prefill: tuple[int, ...], prompt_len: int, num_computed: int, num_scheduled: int, start: int,
    num_top: int,
) -> PromptScoring | None:
    """A request's scoring in a step whose tokens from `start` are its `num_scheduled` next ones
    (None once its prompt is computed, or for a resumed request)."""
    if num_computed >= prompt_len or len(prefill) > prompt_len:
        return None
    positions = prompt_logprob_positions(prompt_len, len(prefill), num_computed, num_scheduled)
    return PromptScoring(req_id, tuple(start + p - num_computed for p in positions),
                         tuple(prefill[p + 1] for p in positions), num_top, num_computed + num_scheduled >= prompt_len)


class PromptLogprobsBuffer:
    """Per-request prompt-logprob chunks, handed out once, when the prompt is complete."""

    def __init__(self) -> None:
        self._parts: dict[str, list[LogprobsArrays]] = {}

    def add(self, req_id: str, part: LogprobsArrays, prompt_done: bool) -> LogprobsArrays | None:
        """Keep `part`; when `prompt_done`, return every part of the request, in order."""
        parts = self._parts.setdefault(req_id, [])
        parts.append(part)
        if not prompt_done:
            return None
        del self._parts[req_id]
        return LogprobsArrays.concat(parts)

    def discard(self, req_id: str) -> None:
        """Forget a finished or preempted request's chunks (a preempted prompt starts over)."""
        self._parts.pop(req_id, None)

    def score(self, scorings: tuple[PromptScoring, ...], score_chunk: ScoreChunk,
              vocab_size: int) -> dict[str, LogprobsArrays]:
        """Score a step's rows chunk by chunk and keep each request's part; the whole prompt's rows
        of each request the step completes."""
        if not scorings:
            return {}
        rows = [r for s in scorings for r in s.rows]
        targets = [t for s in scorings for t in s.targets]
        parts = []
        for lo in range(0, max(len(rows), 1), PROMPT_LOGPROBS_CHUNK):  # one call even for no rows: `scored` needs its columns
            chunk_rows, chunk_targets = (np.zeros(PROMPT_LOGPROBS_CHUNK, np.int32) for _ in range(2))
            n = len(rows[lo : lo + PROMPT_LOGPROBS_CHUNK])
            chunk_rows[:n], chunk_targets[:n] = rows[lo : lo + n], targets[lo : lo + n]
            values, ids, ranks = score_chunk(chunk_rows, chunk_targets)
            parts.append(LogprobsArrays(np.asarray(ids)[:n], np.asarray(values)[:n], np.asarray(ranks)[:n]))
        done, lo = {}, 0
        scored = LogprobsArrays.concat(parts)
        for s in scorings:
            chunk = scored.select(slice(lo, lo + len(s.rows)), vocab_size if s.num_top == -1 else s.num_top)
            lo += len(s.rows)
            complete = self.add(s.req_id, chunk, s.completes)
            if complete is not None:
                done[s.req_id] = complete
        return done
