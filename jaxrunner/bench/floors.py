"""The floors the benchmarks report their figures against (docs/design.md, "Workloads")."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrunner.models.llama import Params

COPY_BANDWIDTH = 4.21e12  # bytes/s an H200 copies, measured (docs/design.md)


def weight_bytes_per_step(params: Params) -> int:
    """Every weight is read once per decode step except an untied embedding table, which is only gathered."""
    total = sum(map(_bytes, jax.tree.leaves(params)))
    return total - (_bytes(params["embed"]) if "lm_head" in params else 0)


def _bytes(x: jax.Array) -> int:
    """As the GPU holds it: int4 packed two to a byte (`nbytes` counts a byte each)."""
    info = jnp.iinfo(x.dtype) if jnp.issubdtype(x.dtype, jnp.integer) else jnp.finfo(x.dtype)
    return x.size * info.bits // 8
