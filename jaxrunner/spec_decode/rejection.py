"""The rejection sampler of speculative decoding (device side): exact, for any sampling parameters.

A step scores request b's drafts d_1..d_n with the target's processed logits at 1 + n positions
(p_0..p_n: the distributions plain sampling would draw from there) and keeps a prefix of them,
then one more token, so that every kept token has exactly the distribution plain sampling gives.

- Drafts without a distribution (n-gram lookup, drafts the caller gives): q is a point mass, so the
  rule below accepts d_i with probability p_{i-1}(d_i) and, on rejection, draws from p_{i-1} with
  d_i removed. Coupled through plain sampling's own noise: the target's sample t_i (stream 0, the
  noise plain sampling uses at that position) is drawn at every position, and d_i is accepted while
  it equals t_i; the first t_i that differs is the correction, t_n the bonus. So the tokens are
  the ones plain sampling gives for the same seed, drafts or not; drafts only decide how many
  positions one step settles.
- Drafts from a draft model with distributions q_i: accept d_i when u_i * q_i(d_i) < p_{i-1}(d_i)
  (probability min(1, p / q)), u_i from stream 1; at the first rejection draw from the normalised
  max(p - q, 0) (stream 2); with every draft accepted, the bonus token is plain sampling's t_n.
Greedy rows have p one-hot at their argmax, so either rule accepts exactly the drafts that equal it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrunner.sampling import SamplingMetadata
from jaxrunner.sampling.sampler import gumbel_noise, uniform_noise

ACCEPT_STREAM, RESIDUAL_STREAM = 1, 2


def target_samples(processed: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Plain sampling's token for each row of processed logits [N, V] (argmax for greedy rows)."""
    greedy = (md.temperature == 0.0)[:, None]
    noisy = jnp.where(greedy, processed, processed + gumbel_noise(md.seeds, md.positions, processed.shape[1]))
    return jnp.argmax(noisy, axis=1).astype(jnp.int32)


def probabilities(processed: jax.Array, md: SamplingMetadata) -> jax.Array:
    """The distribution each row samples from: softmax, or one-hot at the argmax for greedy rows."""
    greedy = (md.temperature == 0.0)[:, None]
    one_hot = jax.nn.one_hot(jnp.argmax(processed, axis=1), processed.shape[1], dtype=jnp.float32)
    return jnp.where(greedy, one_hot, jax.nn.softmax(processed, axis=1))


def draft_sample(processed: jax.Array, md: SamplingMetadata) -> tuple[jax.Array, jax.Array]:
    """A draft model's token per row, drawn as plain sampling would, and the distribution q it
    was drawn from: (tokens i32 [B], q f32 [B, V])."""
    return target_samples(processed, md), probabilities(processed, md)


def verify_drafts(
    processed: jax.Array, md: SamplingMetadata, drafts: jax.Array, num_drafts: jax.Array, draft_probs: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """(tokens i32 [B, 1 + k], how many of them are kept i32 [B], 1 to 1 + num_drafts).

    processed f32 [B * (1 + k), V]: row b * (1 + k) + i is p_i of request b; `md` per row likewise
    (position i: the position of the token that row samples). drafts i32 [B, k], num_drafts i32 [B]
    (drafts past it are ignored), draft_probs f32 [B, k, V] (None: drafts without a distribution).
    """
    b, k = drafts.shape
    vocab = processed.shape[1]
    index = jnp.arange(k)[None, :]
    target = target_samples(processed, md).reshape(b, k + 1)
    valid = index < num_drafts[:, None]
    if draft_probs is None:
        accepted = valid & (drafts == target[:, :k])
        tokens = target
    else:
        p = probabilities(processed, md).reshape(b, k + 1, vocab)[:, :k]
        p_d = jnp.take_along_axis(p, drafts[..., None], axis=2)[..., 0]
        q_d = jnp.take_along_axis(draft_probs, drafts[..., None], axis=2)[..., 0]
        seeds, positions = md.seeds.reshape(b, k + 1, 2)[:, :k], md.positions.reshape(b, k + 1)[:, :k]
        u = uniform_noise(seeds.reshape(-1, 2), positions.reshape(-1), 1, ACCEPT_STREAM).reshape(b, k)
        accepted = valid & (u * q_d < p_d)
        residual = jnp.maximum(p - draft_probs, 0.0)
        residual = jnp.where(jnp.sum(residual, axis=2, keepdims=True) > 0, residual, p)  # p == q: never rejected
        noise = gumbel_noise(seeds.reshape(-1, 2), positions.reshape(-1), vocab, RESIDUAL_STREAM).reshape(b, k, vocab)
        corrected = jnp.argmax(jnp.log(residual) + noise, axis=2).astype(jnp.int32)
        bonus = (index == num_drafts[:, None])
        tokens = jnp.concatenate([jnp.where(accepted, drafts, jnp.where(bonus, target[:, :k], corrected)),
                                  target[:, k:]], axis=1)
    num_accepted = jnp.sum(jnp.cumprod(accepted, axis=1), axis=1)
    return tokens, (num_accepted + 1).astype(jnp.int32)
