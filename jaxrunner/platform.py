"""The one place that asks JAX what it runs on; every platform-dependent default derives from here."""

from __future__ import annotations

import os

import jax
from jax._src import xla_bridge
from jax.sharding import AbstractDevice, AbstractMesh

# For tiling decisions on a machine without streaming multiprocessors (interpret mode): an H200's.
DEFAULT_NUM_SMS = 132
# An H200 to lower GPU kernels for on a machine without one (`jax.sharding.use_abstract_mesh`).
H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=DEFAULT_NUM_SMS, platform="gpu"))


# The share of a GPU's memory JAX's allocator takes when jaxrunner starts the backend: JAX's own default
# is 75%, which left a quarter of the GPU unused under any `gpu_memory_utilization`.
GPU_POOL_FRACTION = 0.95
POOL_VARIABLES = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")  # JAX's, the second deprecated


def claim_gpu_memory() -> None:
    """Before JAX starts its backends, let its GPU allocator take GPU_POOL_FRACTION of the device:
    `gpu_memory_utilization` is a fraction of that pool. A fraction set in the environment stands,
    and so does a backend already started (its pool is fixed)."""
    if not xla_bridge.backends_are_initialized() and not any(os.environ.get(v) for v in POOL_VARIABLES):
        os.environ[POOL_VARIABLES[0]] = str(GPU_POOL_FRACTION)


# XLA autotunes each Triton matmul fusion over every tiling of its candidate list, compiling and timing
# each: most of a cold start's compile work. Its cost model can rank the tilings first, so that only
# the best few are compiled and timed; how few keeps W1 and W2 is measured in docs/benchmarks.md.
# The flag is experimental: a jaxlib without it aborts at start-up (the pin on jax holds it).
GEMM_TILINGS_FLAG = "--xla_gpu_experimental_cost_model_gemm_tiling_options"
GEMM_TILINGS_TIMED = 8


def limit_gemm_autotuning() -> None:
    """Before JAX starts its backends, have XLA time only the cost model's best GEMM_TILINGS_TIMED
    tilings of a matmul. A setting of the flag in XLA_FLAGS stands, and so does a started backend's
    (XLA reads the variable once)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if not xla_bridge.backends_are_initialized() and GEMM_TILINGS_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {GEMM_TILINGS_FLAG}=top={GEMM_TILINGS_TIMED}".strip()


def use_compilation_cache(path: str) -> None:
    """JAX's persistent compilation cache in `path`, every program kept however fast it compiled."""
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def memory_stats(device: int = 0) -> dict | None:
    """The allocator's figures of device `device` (bytes in use, its limit, the largest free block)
    on a GPU; None elsewhere."""
    return jax.devices()[device].memory_stats() if on_gpu() else None


def num_sms() -> int:
    """The first device's streaming multiprocessors (its `core_count` on a GPU)."""
    return getattr(jax.devices()[0], "core_count", None) or DEFAULT_NUM_SMS
