"""The runner's compiled programs: one executable per (function, bucket, static options).

`jax.jit` compiles on first use, and serving must not compile; so the runner keeps its executables
itself, keyed by what makes them differ. `compile_all` lowers the programs one after another
(tracing is Python) and compiles them on a thread pool, where XLA works without the GIL: start-up
then takes about the longest compiles, not their sum. A program nobody compiled ahead compiles on
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
        """Compile the programs not compiled yet, in parallel; how many were compiled."""
        todo = {p.key: p for p in programs if p.key not in self._compiled}
        lowered = [(key, p.fn.lower(*p.args, **p.statics)) for key, p in todo.items()]
        workers = workers or min(len(lowered), os.cpu_count() or 1) or 1
        with ThreadPoolExecutor(workers) as pool:
            for (key, _), exe in zip(lowered, pool.map(lambda kl: kl[1].compile(), lowered)):
                self._compiled[key] = exe
        return len(lowered)
