"""The Mixture-of-Experts MLP (Mixtral, Qwen3-MoE): a router picks each token's top-k experts, and
the experts run as two grouped matmuls over the token copies sorted by expert
(`jax.lax.ragged_dot`'s function), with no loop over experts and no per-expert weight gather.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxrunner.config import ModelConfig

GroupedMatmul = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]  # (lhs [M, K], rhs [E, K, N], sizes [E])


def route(logits: jax.Array, k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """(weights f32 [T, k], experts i32 [T, k]): the softmax over every expert (in float32, as both
    families compute it), its k largest, renormalised to sum to one when `normalize`."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


def moe_mlp(x: jax.Array, router: jax.Array, gate_up: jax.Array, down: jax.Array, act, cfg: ModelConfig,
            valid: jax.Array | None = None, grouped_matmul: GroupedMatmul = jax.lax.ragged_dot) -> jax.Array:
    """[T, H] for x [T, H]: router [H, E], gate_up [E, H, 2I] (gate | up), down [E, I, H]. Tokens
    not `valid` (bool [T]: a bucket's padding) go to no expert: their copies sort past the last
    group, where the grouped matmul computes nothing (their rows come out zero). `grouped_matmul`:
    `ragged_dot`'s function (the runner's choice: XLA's, or the Pallas kernel that reads only the
    experts in use)."""
    k = cfg.num_experts_per_tok
    weights, experts = route(x @ router, k, cfg.norm_topk_prob)
    if valid is not None:
        experts = jnp.where(valid[:, None], experts, cfg.num_experts)  # past the last group: no expert's rows
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # the T * k token copies, expert by expert
    tokens = order // k
    sizes = jnp.bincount(flat, length=cfg.num_experts).astype(jnp.int32)
    gate, up = jnp.split(grouped_matmul(x[tokens], gate_up, sizes), 2, axis=-1)
    out = grouped_matmul(act(gate) * up, down, sizes)
    out = out * weights.reshape(-1)[order][:, None].astype(out.dtype)  # the weights in the model's dtype, as HF
    return jnp.zeros_like(x).at[tokens].add(out)
