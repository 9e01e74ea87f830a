"""The runner's compiled programs: one executable per (function, bucket, static options).

`jax.jit` compiles on first use, and serving must not compile; so the runner keeps its executables
itself, keyed by what makes them differ. `compile_all` lowers the programs one after another
(tracing is Python) and compiles them on a thread pool, where XLA works without the GIL, each
compile starting as soon as its program is lowered; with a `ProgramCache` it first looks for the
executable on disk, which needs no lowering. A program nobody compiled ahead compiles on first use
and is counted in `compiled_on_use`, so a test can assert that serving compiled nothing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import jax

from jaxrunner.program_cache import ProgramCache


@dataclass(frozen=True)
class Program:
    """A jitted function with its static options, and example arguments to lower it with."""

    key: Hashable
    fn: Callable
    args: tuple
    statics: dict


class Programs:
    def __init__(self, cache: ProgramCache | None = None) -> None:
        self._compiled: dict[Hashable, jax.stages.Compiled] = {}
        self._cache = cache
        self.compiled_on_use = 0
        self.loaded = 0  # by compile_all from the program cache
        self.lowering_seconds = 0.0  # spent by compile_all under the GIL: what no compile thread overlaps

    def __contains__(self, key: Hashable) -> bool:
        return key in self._compiled

    def run(self, program: Program):
        exe = self._compiled.get(program.key)
        if exe is None:
            exe = self._compiled[program.key] = program.fn.lower(*program.args, **program.statics).compile()
            self.compiled_on_use += 1
        return exe(*program.args)

    def get(self, program: Program) -> jax.stages.Compiled:
        """The executable, compiled now if needed (not counted: for inspection, e.g. memory_analysis)."""
        if program.key not in self._compiled:
            self.compile_all([program])
        return self._compiled[program.key]

    def compile_all(self, programs: Sequence[Program], workers: int | None = None) -> int:
        """Make the programs not compiled yet ready, in parallel; how many that was. Those in the
        program cache are loaded; each other is lowered and handed to the pool at once, so lowering
        the next (Python, under the GIL) overlaps compiling the previous ones: list the slowest
        compiles first."""
        todo = {p.key: p for p in programs if p.key not in self._compiled}
        cache_keys = {key: self._cache.key(p.fn, p.key, p.args, p.statics) for key, p in todo.items()} if self._cache else {}
        workers = workers or min(len(todo), os.cpu_count() or 1) or 1
        with ThreadPoolExecutor(workers) as pool:
            if cache_keys:
                for key, exe in zip(cache_keys, pool.map(self._cache.load, cache_keys.values())):
                    if exe is not None:
                        self._compiled[key] = exe
                        self.loaded += 1
            futures = {}
            for key, p in todo.items():
                if key not in self._compiled:
                    start = time.perf_counter()
                    lowered = p.fn.lower(*p.args, **p.statics)
                    self.lowering_seconds += time.perf_counter() - start
                    futures[key] = pool.submit(self._compile, lowered, cache_keys.get(key))
            for key, future in futures.items():
                self._compiled[key] = future.result()
        return len(todo)

    def _compile(self, lowered: jax.stages.Lowered, cache_key: str | None) -> jax.stages.Compiled:
        exe = lowered.compile()
        if cache_key:
            self._cache.store(cache_key, exe)
        return exe
