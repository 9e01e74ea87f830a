"""Logprobs of chosen tokens plus the top N, on the device.

`compute_logprobs` serves both sampled tokens and prompt logprobs (`prompt_logprobs.py`): column 0
is the target token, columns 1.. the N largest; the rank is 1-based, the number of logits >= the
target's, as in vLLM.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

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
