"""The one place that asks JAX what it runs on; every platform-dependent default derives from here."""

from __future__ import annotations

import jax
from jax.sharding import AbstractDevice, AbstractMesh

# For tiling decisions on a machine without streaming multiprocessors (interpret mode): an H200's.
DEFAULT_NUM_SMS = 132
# An H200 to lower GPU kernels for on a machine without one (`jax.sharding.use_abstract_mesh`).
H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=DEFAULT_NUM_SMS, platform="gpu"))


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def num_sms() -> int:
    """The first device's streaming multiprocessors (its `core_count` on a GPU)."""
    return getattr(jax.devices()[0], "core_count", None) or DEFAULT_NUM_SMS
