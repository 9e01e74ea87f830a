"""Logprobs of chosen tokens plus the top N (device), and the host bookkeeping for prompt logprobs.

`compute_logprobs` serves both sampled tokens and prompt logprobs: column 0 is the target token,
columns 1.. the N largest; the rank is 1-based, the number of logits >= the target's, as in vLLM.

Prompt logprobs (vLLM semantics): the logits at position p score prompt token p + 1, so a prompt of
length P yields P - 1 rows. A request prefilled in chunks computes its rows chunk by chunk
(`prompt_logprob_positions`), a `PromptLogprobsBuffer` keeps them, and they are emitted once, in
the step that completes the prompt. A request resumed after preemption (its prefill holds
generated tokens too) emitted them before it was preempted, so it computes none.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxrunner.step_io import LogprobsArrays

TOP_K_ROUND = 16


def compute_logprobs(
    logits: jax.Array, target_ids: jax.Array, num_top: int, as_logits: bool = False
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(values f32 [N, 1 + num_top], token ids i32 [N, 1 + num_top], target ranks i32 [N]).

    logits f32 [N, V], target_ids i32 [N]. Values are log-softmax of `logits`, or the logits
    themselves when `as_logits` (vLLM's *_logits modes).
    """
    target_ids = target_ids.astype(jnp.int32)
    token_ids = jnp.concatenate([target_ids[:, None], top_ids(logits, num_top)], axis=1)
    values = jnp.take_along_axis(logits, token_ids, axis=1)
    if not as_logits:
        values = values - jax.nn.logsumexp(logits, axis=1, keepdims=True)
    ranks = jnp.sum(logits >= _values_at(logits, target_ids)[:, None], axis=1, dtype=jnp.int32)
    return values, token_ids, ranks


def top_ids(x: jax.Array, n: int) -> jax.Array:
    """Ids i32 [N, n] of each row's n largest values, largest first (lowest id first among ties).

    lax.top_k in rounds of at most TOP_K_ROUND, the found ids masked out between rounds: XLA's
    fast GPU top-k stops at k = 16 and falls back to a full sort above it, which costs more than the
    rounds (docs/benchmarks.md). Masked-out tokens (-inf) are lifted to the lowest finite value
    first, so that the masking below them keeps the ids distinct.
    """
    rows = jnp.arange(x.shape[0])[:, None]
    x = jnp.where(x == -jnp.inf, jnp.finfo(x.dtype).min, x)
    found = []
    for k in [TOP_K_ROUND] * (n // TOP_K_ROUND) + [n % TOP_K_ROUND] * (n % TOP_K_ROUND > 0):
        ids = lax.top_k(x, k)[1].astype(jnp.int32)
        found.append(ids)
        x = x.at[rows, ids].set(-jnp.inf)
    return jnp.concatenate(found, axis=1) if found else jnp.zeros((x.shape[0], 0), jnp.int32)


def _values_at(x: jax.Array, ids: jax.Array) -> jax.Array:
    return jnp.take_along_axis(x, ids[:, None], axis=1)[:, 0]


def prompt_logprob_positions(prompt_len: int, prefill_len: int, num_computed: int, num_scheduled: int) -> range:
    """Positions of this step's chunk whose logits score a prompt token (position p scores p + 1).

    Empty for a request resumed after preemption (prefill_len > prompt_len).
    """
    if prefill_len > prompt_len:
        return range(0)
    return range(num_computed, max(num_computed, min(num_computed + num_scheduled, prompt_len - 1)))


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
