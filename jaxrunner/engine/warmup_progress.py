"""Warm-up's progress for people: compiling every program takes a while on a cold start, and a
silent start looks hung. On a terminal a bar (programs ready of all, the time left at the rate so
far); in a log (a server's, or any stderr that is no terminal) a line at every tenth."""

from __future__ import annotations

import logging
import sys
import time

from tqdm import tqdm

logger = logging.getLogger(__name__)


class WarmupProgress:
    """`Runner.warmup`'s `progress(done, total)`."""

    def __init__(self) -> None:
        self._bar: tqdm | None = None
        self._start = time.perf_counter()
        self._logged = 0  # tenths logged

    def __call__(self, done: int, total: int) -> None:
        if sys.stderr.isatty():
            if self._bar is None:
                self._bar = tqdm(total=total, desc="warm-up: compiling programs", unit="program", dynamic_ncols=True)
            self._bar.update(done - self._bar.n)
            if done == total:
                self._bar.close()
            return
        tenth = 10 * done // total if total else 10
        if tenth > self._logged:
            self._logged = tenth
            elapsed = time.perf_counter() - self._start
            left = elapsed * (total - done) / done if done else 0.0
            logger.info("warm-up: %d of %d programs ready, %.0f s so far, about %.0f s left", done, total, elapsed, left)
