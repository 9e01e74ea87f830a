"""The Mixture-of-Experts MLP (Mixtral, Qwen3-MoE): a router picks each token's top-k experts, and
the experts run as two grouped matmuls over the token copies sorted by expert
(`jax.lax.ragged_dot`'s function), with no loop over experts and no per-expert weight gather.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxrunner.config import ModelConfig
from jaxrunner.models.row_tiles import row_tiled, summed_in_order
from jaxrunner.models.tensors import MODEL_AXIS

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
            valid: jax.Array | None = None, grouped_matmul: GroupedMatmul = jax.lax.ragged_dot,
            batch_invariant: bool = False) -> jax.Array:
    """[T, H] for x [T, H]: router [H, E], gate_up [E, H, 2I] (gate | up), down [E, I, H]. Tokens
    not `valid` (bool [T]: a bucket's padding) go to no expert: their copies sort past the last
    group, where the grouped matmul computes nothing (their rows come out zero). `grouped_matmul`:
    `ragged_dot`'s function (the runner's choice: XLA's, or the Pallas kernel that reads only the
    experts in use). `batch_invariant`: each token's bits its own, whatever the batch routes beside
    it (`RunnerConfig.batch_invariant`): the router a tile of rows at a time, the grouped matmul one
    in tiles of a fixed size (the runner's choice), a token's k outputs added in their order (a
    scatter-add's order is the device's: atomics on a GPU), and split over devices, their outputs
    added in device order (`row_tiles.summed_in_order`).

    On a mesh that splits MODEL_AXIS the experts are split by expert (expert parallelism, the
    gather-compute-reduce form): every device routes all the tokens (x is whole on each after the
    attention's all-reduce), runs the copies bound for its own experts, and one all-reduce sums
    the devices' outputs, as the dense MLP's down projection ends. An all-to-all of the copies
    would move fewer bytes, but at decode's few tokens a step is bound by reading the experts, and
    this form keeps one collective per layer with no capacity to size."""
    if batch_invariant and grouped_matmul is jax.lax.ragged_dot:
        raise ValueError("a batch-invariant MoE MLP needs a grouped matmul in fixed tiles (`step.moe_matmul` "
                         "chooses one): ragged_dot's products follow the batch")
    experts = functools.partial(_experts, grouped_matmul=grouped_matmul, batch_invariant=batch_invariant)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.shape.get(MODEL_AXIS, 1) == 1:
        return experts(x, router, gate_up, down, act, cfg, valid, split=False)
    valid = jnp.ones(x.shape[:1], bool) if valid is None else valid
    by_expert = P(MODEL_AXIS)

    def local(x, router, gate_up, down, valid):
        out = experts(x, router, gate_up, down, act, cfg, valid, split=True)
        return summed_in_order(out, MODEL_AXIS) if batch_invariant else jax.lax.psum(out, MODEL_AXIS)

    return jax.shard_map(local, in_specs=(P(), P(), by_expert, by_expert, P()), out_specs=P(),
                         check_vma=False)(x, router, gate_up, down, valid)


def _experts(x: jax.Array, router: jax.Array, gate_up: jax.Array, down: jax.Array, act, cfg: ModelConfig,
             valid: jax.Array | None, split: bool, grouped_matmul: GroupedMatmul, batch_invariant: bool) -> jax.Array:
    """The MLP over the experts held here: all of them, or (`split`) this device's slice of
    MODEL_AXIS, the copies bound elsewhere sorted past its last group like padding's."""
    t, k, held = x.shape[0], cfg.num_experts_per_tok, gate_up.shape[0]

    def routed(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        return route(x @ router, k, cfg.norm_topk_prob)

    weights, experts = row_tiled(routed, x) if batch_invariant else routed(x)
    keep = None if valid is None else valid[:, None]
    if split:
        experts = experts - jax.lax.axis_index(MODEL_AXIS) * held
        keep = keep & (experts >= 0) & (experts < held)
    if keep is not None:
        experts = jnp.where(keep, experts, held)  # past the last group: no expert's rows
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # the T * k token copies, expert by expert
    tokens = order // k
    sizes = jnp.bincount(flat, length=held).astype(jnp.int32)
    gate, up = jnp.split(grouped_matmul(x[tokens], gate_up, sizes), 2, axis=-1)
    out = grouped_matmul(act(gate) * up, down, sizes)
    out = out * weights.reshape(-1)[order][:, None].astype(out.dtype)  # the weights in the model's dtype, as HF
    if not batch_invariant:
        return jnp.zeros_like(x).at[tokens].add(out)
    by_token = jnp.zeros_like(out).at[order].set(out).reshape(t, k, -1)  # back in copy order: no sums
    return functools.reduce(jnp.add, [by_token[:, j] for j in range(k)])
