"""A dispatched step's output on its way from the device: `get()` waits for it and builds the RunnerOutput."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from jaxrunner.sampling import SamplerOutput
from jaxrunner.step_io import LogprobsArrays, RunnerOutput


@dataclass(frozen=True)
class PendingOutput:
    """`steps[rid]` tokens were sampled for each request that samples (device arrays in `sampled`,
    [B] for one step or [num_steps, B], batch column i for `req_ids[i]`); with speculative decoding,
    at most that many: `num_kept` [B] says how many, and `drafts` [B, k] holds the next drafts.
    `num_top[rid]` is the number of top logprobs it asked for (-1: none)."""

    req_ids: list[str]
    steps: dict[str, int]
    num_top: dict[str, int]
    sampled: SamplerOutput | None  # None for an empty step
    prompt_logprobs: dict[str, LogprobsArrays]
    num_kept: jax.Array | None = None  # speculative decoding only
    drafts: jax.Array | None = None  # speculative decoding only

    def get(self) -> RunnerOutput:
        if not self.req_ids:
            return RunnerOutput([], {}, [])
        out, kept, drafts = jax.device_get((self.sampled, self.num_kept, self.drafts))
        next_drafts = [] if drafts is None else drafts.tolist()  # one conversion, not one per request
        if out.tokens.ndim == 1:  # a single step
            out = jax.tree.map(lambda x: x[None], out)
        tokens, logprobs, nans = [], {}, {}
        for i, rid in enumerate(self.req_ids):
            n = self.steps.get(rid, 0)
            if kept is not None and n:
                n = min(n, int(kept[i]))
            tokens.append(out.tokens[:n, i].tolist())
            nans[rid] = int(np.sum(out.num_nans[: max(n, 1), i]))
            if n and self.num_top[rid] >= 0:
                rows = LogprobsArrays(out.logprob_token_ids[:n, i], out.logprobs[:n, i], out.ranks[:n, i])
                logprobs[rid] = rows.select(slice(None), self.num_top[rid])
        return RunnerOutput(
            req_ids=self.req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(self.req_ids)},
            sampled_token_ids=tokens,
            logprobs=logprobs,
            prompt_logprobs_dict=self.prompt_logprobs,
            num_nans_in_logits=nans,
            draft_token_ids={rid: ids for rid, ids in zip(self.req_ids, next_drafts) if self.steps.get(rid)},
        )
