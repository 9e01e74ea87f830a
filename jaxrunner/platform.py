"""The one place that asks JAX what it runs on; every platform-dependent default derives from here."""

from __future__ import annotations

import jax

# For tiling decisions on a machine without streaming multiprocessors (interpret mode): an H200's.
DEFAULT_NUM_SMS = 132


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def num_sms() -> int:
    """The first device's streaming multiprocessors (its `core_count` on a GPU)."""
    return getattr(jax.devices()[0], "core_count", None) or DEFAULT_NUM_SMS
