"""N-gram prompt lookup on the device: drafts for speculative decoding without a draft model.

For each row, the last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) are looked
up among its earlier tokens; the k tokens that followed the latest earlier occurrence of the longest
n that matches are the drafts. Vectorised over rows and positions: a handful of shifted
comparisons of the [B, L] token rows, no loop over tokens. A row with no match gets its last token
repeated, drafts that simply fail verification (the step still keeps one token).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ngram_drafts(tokens: jax.Array, lens: jax.Array, k: int, n_min: int, n_max: int) -> jax.Array:
    """Drafts i32 [B, k] for rows `tokens` i32 [B, L] whose first `lens` [B] tokens are known."""
    b, length = tokens.shape
    cols = jnp.arange(length)[None, :]
    last = jnp.clip(lens - 1, 0, length - 1)[:, None]

    def at(index: jax.Array) -> jax.Array:
        return jnp.take_along_axis(tokens, jnp.clip(index, 0, length - 1), axis=1)

    # match[n][b, j]: the n tokens ending at j equal the n tokens ending at the row's last token.
    match = jnp.ones((b, length), bool)
    start = jnp.full(b, -1, jnp.int32)  # position after the chosen occurrence; -1: none yet
    for n in range(1, n_max + 1):
        shifted = at(cols - (n - 1))
        match = match & (shifted == at(last - (n - 1))) & (cols - (n - 1) >= 0)
        if n >= n_min:
            found = match & (cols < last) & (lens[:, None] > n)
            latest = jnp.max(jnp.where(found, cols, -1), axis=1)
            start = jnp.where(latest >= 0, latest + 1, start)  # a longer n overrides a shorter one
    index = jnp.where(start[:, None] >= 0, start[:, None] + jnp.arange(k)[None, :], last)
    return at(jnp.minimum(index, last))
