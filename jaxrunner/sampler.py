"""Token sampling: greedy and temperature with per-request seeds.

Gumbel-max: argmax(logits / T + g) with g ~ Gumbel drawn from a key that depends only on the
request's seed and the position of the token being sampled, so a seeded request gives the same
tokens whatever batch, bucket or step it lands in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrunner.pytree import pytree_dataclass


@pytree_dataclass
class SamplingMetadata:
    """Per-row sampling inputs for one request bucket ([B] rows)."""

    temperature: jax.Array  # f32 [B]; 0 = greedy
    seeds: jax.Array  # u32 [B, 2]: a 64-bit seed as threefry key data
    positions: jax.Array  # i32 [B]: position of the token being sampled


def gumbel_noise(seeds: jax.Array, positions: jax.Array, vocab_size: int) -> jax.Array:
    """Gumbel noise [B, V] that depends only on (seed, position) of each row."""

    def row(seed: jax.Array, pos: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.wrap_key_data(seed, impl="threefry2x32"), pos)
        return jax.random.gumbel(key, (vocab_size,), jnp.float32)

    return jax.vmap(row)(seeds, positions)


def sample(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Sample one token per row from fp32 logits [B, V]."""
    greedy = md.temperature <= 0.0
    temp = jnp.where(greedy, 1.0, md.temperature)[:, None]
    noisy = logits / temp + gumbel_noise(md.seeds, md.positions, logits.shape[-1])
    return jnp.where(greedy, jnp.argmax(logits, axis=-1), jnp.argmax(noisy, axis=-1)).astype(jnp.int32)
