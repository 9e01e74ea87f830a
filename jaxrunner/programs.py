"""The runner's compiled programs: one executable per (function, bucket, static options).

`jax.jit` compiles on first use, and serving must not compile; so the runner keeps its executables
itself, keyed by what makes them differ. `compile_all` lowers the programs one after another
(tracing is Python) and compiles them on a thread pool, where XLA works without the GIL, each
compile starting as soon as its program is lowered. A program nobody compiled ahead compiles on
first use and is counted in `compiled_on_use`, so a test can assert that serving compiled nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import jax


@dataclass(frozen=True)
class Program:
    """A jitted function with its static options, and example arguments to lower it with."""

    key: Hashable
    fn: Callable
    args: tuple
    statics: dict


class Programs:
    def __init__(self) -> None:
        self._compiled: dict[Hashable, jax.stages.Compiled] = {}
        self.compiled_on_use = 0

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
        """Compile the programs not compiled yet, in parallel; how many were compiled. Each program is
        handed to the pool as soon as it is lowered, so lowering the next (Python, under the GIL)
        overlaps compiling the previous ones: list the slowest compiles first."""
        todo = {p.key: p for p in programs if p.key not in self._compiled}
        workers = workers or min(len(todo), os.cpu_count() or 1) or 1
        with ThreadPoolExecutor(workers) as pool:
            futures = {key: pool.submit(p.fn.lower(*p.args, **p.statics).compile) for key, p in todo.items()}
            for key, future in futures.items():
                self._compiled[key] = future.result()
        return len(todo)
