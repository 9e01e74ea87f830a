"""Compiled programs on disk, found without lowering them.

JAX's persistent compilation cache keys an executable by its lowered module, so a warm start still
lowers every program (traces it, emits StableHLO and the Pallas kernels' Triton IR) under the GIL,
which was nearly all of a cached warm-up (docs/benchmarks.md). This cache keys a program by what
its lowering is made from instead: the source of jaxrunner and pallas_kernels, the jax version and
flags, the device, the function, its static options and its arguments' structure, shapes and dtypes.
A warm start then only loads executables. A file that does not load is compiled again and rewritten.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pathlib
import pickle
import threading

import jax
import jaxlib
import numpy as np
from jax.experimental.serialize_executable import deserialize_and_load, serialize

logger = logging.getLogger(__name__)


PACKAGES = pathlib.Path(__file__).parents[2]  # the directory that holds jaxrunner and pallas_kernels


def source_files() -> list[pathlib.Path]:
    """The sources a program's lowering is made from."""
    return [path for name in ("jaxrunner", "pallas_kernels") for path in sorted((PACKAGES / name).rglob("*.py"))]


@functools.cache
def _source_digest() -> str:
    digest = hashlib.sha256()
    for path in source_files():
        digest.update(str(path.relative_to(PACKAGES)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _environment() -> tuple:
    device = jax.devices()[0]
    flags = ("jax_enable_x64", "jax_explicit_x64_dtypes", "jax_default_matmul_precision")
    return (
        jax.__version__, jaxlib.__version__, device.platform, device.device_kind, device.client.platform_version,
        os.environ.get("XLA_FLAGS", ""), tuple(jax.config.values.get(flag) for flag in flags), _source_digest(),
    )


_compiles = threading.local()  # per compiling thread: whether its compile ran XLA


def _note_cache_hit(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _compiles.hit = True


def _note_compile(event: str, duration: float, **_) -> None:
    if event == "/jax/core/compile/backend_compile_duration":  # XLA, or JAX's persistent cache
        _compiles.ran = True


jax.monitoring.register_event_listener(_note_cache_hit)
jax.monitoring.register_event_duration_secs_listener(_note_compile)


def compile_noting_cache_hits(lowered: jax.stages.Lowered) -> tuple[jax.stages.Compiled, bool]:
    """The executable, and whether XLA compiled it in this call. Only such a one may be stored: one
    JAX loaded from its persistent cache serializes into a file that XLA:CPU loads but cannot run
    ("Function ... not found"), and JAX hands back, with neither event, an executable it holds in
    memory for the same lowering, which an earlier compile may have loaded so."""
    _compiles.ran = _compiles.hit = False
    exe = lowered.compile()
    return exe, _compiles.ran and not _compiles.hit


class ProgramCache:
    """Executables under `directory`, one file per program, named by `key`."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = pathlib.Path(directory).expanduser()

    def key(self, fn: jax.stages.Wrapped, name: object, args: tuple, statics: dict) -> str:
        """What the lowering of `fn(*args, **statics)` depends on, hashed; `name` is the runner's key."""
        leaves, treedef = jax.tree.flatten(args)
        signature = [(np.shape(x), str(getattr(x, "dtype", type(x).__name__)), getattr(x, "weak_type", False)) for x in leaves]
        function = (fn.__module__, fn.__qualname__)
        text = repr((_environment(), function, name, sorted(statics.items()), str(treedef), signature))
        return hashlib.sha256(text.encode()).hexdigest()

    def load(self, key: str) -> jax.stages.Compiled | None:
        path = self.directory / f"{key}.jaxexe"
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            (payload, in_tree, out_tree), device_ids = pickle.loads(data)
            devices = {d.id: d for d in jax.devices()}
            return deserialize_and_load(payload, in_tree, out_tree, execution_devices=[devices[i] for i in device_ids])
        except Exception as e:  # a truncated or foreign file: compiling again is always safe
            logger.warning("compiling again: cannot load the cached program %s (%s: %s)", path, type(e).__name__, e)
            return None

    def store(self, key: str, compiled: jax.stages.Compiled) -> None:
        """Write the executable and the ids of the devices it runs on (not every device of the host);
        one that cannot be serialized (closed-over constants) stays uncached."""
        device_ids = [d.id for d in compiled.runtime_executable().local_devices()]
        try:
            data = pickle.dumps((serialize(compiled), device_ids))
        except (ValueError, NotImplementedError) as e:
            logger.info("program %s not cached: %s", key, e)
            return
        self._write(f"{key}.jaxexe", data)

    def load_figure(self, key: str) -> int | None:
        """A number `store_figure` kept under `key`, or None."""
        try:
            return int((self.directory / f"{key}.figure").read_text())
        except (FileNotFoundError, ValueError):
            return None

    def store_figure(self, key: str, value: int) -> None:
        """Keep a number a later start would otherwise measure again or choose otherwise: one
        measured from executables (keyed by theirs), which it then need not load, or the KV
        blocks a start took (keyed by the sizing)."""
        self._write(f"{key}.figure", str(value).encode())

    def _write(self, name: str, data: bytes) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        temporary = self.directory / f"{name}.{os.getpid()}.{threading.get_ident()}.tmp"  # a step's and warm-up's
        temporary.write_bytes(data)
        os.replace(temporary, self.directory / name)  # readers never see a partial file
