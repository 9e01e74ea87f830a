"""The floors the benchmarks report their figures against (docs/design.md, "Workloads")."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrunner.models.llama import Params

EXPERT_WEIGHTS = ("experts_gate_up", "experts_down")  # `models.tensors`' names of the experts' weights
COPY_BANDWIDTH = 4.21e12  # bytes/s an H200 copies, measured (docs/design.md)


def weight_bytes_per_step(params: Params, tokens: int = 1, experts_per_tok: int = 0) -> int:
    """The weight bytes a decode step of `tokens` tokens reads: every weight once, except an untied
    embedding table, which is only gathered, and a Mixture-of-Experts layer's experts, of which only
    those the tokens route to (each token to `experts_per_tok` of E): if the router picked uniformly
    and independently, E (1 - (1 - k / E)^tokens) experts in expectation (k at batch 1)."""
    total = sum(map(_bytes, jax.tree.leaves(params)))
    total -= _bytes(params["embed"]) if "lm_head" in params else 0
    experts = [p[name] for p in params["layers"] for name in EXPERT_WEIGHTS if name in p]
    if experts:
        num_experts = experts[0].shape[0]
        unread = (1 - experts_per_tok / num_experts) ** tokens  # an expert's chance of no token
        total -= round(sum(map(_bytes, experts)) * unread)
    return total


def _bytes(x: jax.Array) -> int:
    """As the GPU holds it: int4 packed two to a byte (`nbytes` counts a byte each)."""
    info = jnp.iinfo(x.dtype) if jnp.issubdtype(x.dtype, jnp.integer) else jnp.finfo(x.dtype)
    return x.size * info.bits // 8
