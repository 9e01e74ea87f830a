"""One throw-away cache for the whole run, not the user's ~/.cache/jaxrunner: pytest-xdist's
controller makes it, and its workers and the subprocesses tests start inherit it through the
environment. So a GGUF checkpoint one worker converted serves the other (a conversion appears by
renaming its directory), and so does a program one worker compiled, from the cache's `xla` folder:
JAX's persistent cache (a reader that finds a file still being written compiles again) and the
program cache (files appear by atomic rename).

JAX's caches keep every executable compiled in the process, each with memory maps of its own, and
the whole suite would pass Linux's limit of 65530 maps per process, where XLA:CPU crashes (SIGSEGV
or SIGABRT, while compiling or serializing). So a test that leaves the process holding many maps
clears those caches (executables of live runners stay: their `Programs` hold them).

Off a GPU, XLA:CPU compiles with LLVM's optimizations off: most of the suite's time goes to
compiling, which this shortens more than it slows the runs (the checks, Hugging Face goldens
included, hold at either level). It also shows four CPU devices, for the tensor-parallel tests;
everything else runs on the first.
"""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import tempfile

GPU = shutil.which("nvidia-smi") is not None
if GPU and not any(os.environ.get(v) for v in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")):
    os.environ["XLA_CLIENT_MEM_FRACTION"] = "0.75"  # JAX's default pool: the rest for torch's Hugging Face references
if not GPU:  # four CPU devices: the tensor-parallel tests split over them
    flags = os.environ.get("XLA_FLAGS", "").split()  # the workers inherit the controller's
    os.environ["XLA_FLAGS"] = " ".join(flags + [f for f in ("--xla_backend_optimization_level=0",
                                                            "--xla_force_host_platform_device_count=4") if f not in flags])

import jax  # noqa: E402  (after XLA_FLAGS)
import pytest

if "JAXRUNNER_CACHE" not in os.environ:
    os.environ["JAXRUNNER_CACHE"] = tempfile.mkdtemp(prefix="jaxrunner-test-cache-")
    atexit.register(shutil.rmtree, os.environ["JAXRUNNER_CACHE"], True)


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts) on a GPU machine: no workers, each would claim most of the
    GPU's memory. Elsewhere xdist's own count, a worker per core."""
    return 0 if GPU else None


MAPS = "/proc/self/maps"
MAX_MAPS = 20000  # well below Linux's default limit of 65530


@pytest.fixture(autouse=True)
def _free_executables():
    yield
    if os.path.exists(MAPS):
        with open(MAPS) as f:
            if sum(1 for _ in f) > MAX_MAPS:
                gc.collect()
                jax.clear_caches()


@pytest.fixture
def fresh_jax_cache():
    """JAX's compilation caches as a fresh process finds them: none in memory, the persistent one off
    until a runner names its directory (then initialized there anew). Program-cache tests use it,
    so that executables JAX holds or stored for other tests (which the program cache never stores)
    cannot stand in for their compiles."""
    from jax.experimental.compilation_cache import compilation_cache

    old = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()
    jax.clear_caches()
    yield
    jax.config.update("jax_compilation_cache_dir", old)
    compilation_cache.reset_cache()
