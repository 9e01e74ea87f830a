"""The floors the benchmarks report their figures against (docs/design.md, "Workloads")."""

from __future__ import annotations

import jax

from jaxrunner.models.llama import Params

COPY_BANDWIDTH = 4.21e12  # bytes/s an H200 copies, measured (docs/design.md)


def weight_bytes_per_step(params: Params) -> int:
    """Every weight is read once per decode step except an untied embedding table, which is only gathered."""
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    return total - (params["embed"].nbytes if "lm_head" in params else 0)
