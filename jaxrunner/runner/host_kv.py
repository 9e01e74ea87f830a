"""The bytes of the prefix cache's host tier: a pool of KV blocks in host memory, and the copies
between it and the device's cache that each step's `KVTransfers` asks for. The books (which
block is in which slot) are the engine's (`engine.host_tier`); they rely on this order within a step:

  1. the earlier steps' loads that are on the device by now (`arrived`) are written into their
     blocks (SCATTER_BLOCKS) before anything of this step runs;
  2. this step's loads are read from the pool, once every earlier save into their slots has
     landed, and start their copy to the device (step 1 of a later step writes them);
  3. this step's saves are gathered from the cache (GATHER_BLOCKS) before the step's programs
     write it, and start their copy to the host; each lands in the pool when it has arrived, or
     when a load needs its slot.

So both copies run while the device computes, and no step waits on one: the scheduler admits a
request whose blocks are loading once `arrived` counts them. Every page of a block moves: each
layer's K and V, and a draft model's.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import jax
import numpy as np

from jaxrunner.runner.context import Context
from jaxrunner.runner.input_batch import bucket
from jaxrunner.runner.programs import GATHER_BLOCKS, SCATTER_BLOCKS, Programs
from jaxrunner.runner.state import RunnerState
from jaxrunner.step_io import KVTransfers, reject


@dataclass
class HostKVStats:
    bytes_saved: int = 0  # device to host
    bytes_loaded: int = 0  # host to device
    seconds: float = 0.0  # host time the copies took from the steps (waits for a save included)


class HostKV:
    def __init__(self, ctx: Context, programs: Programs) -> None:
        self.programs = programs
        self.buckets = ctx.kv_transfer_buckets
        self.num_blocks = ctx.config.num_blocks
        leaves = ctx.kv_blocks(ctx.config.num_host_blocks)
        self.pool = [np.zeros(leaf.shape, leaf.dtype) for leaf in leaves]  # untouched pages take no memory
        self.shardings = [leaf.sharding or jax.devices()[0] for leaf in leaves]
        self.block_bytes = sum(pool[0].nbytes for pool in self.pool)
        self._saving: deque[tuple[np.ndarray, tuple[jax.Array, ...]]] = deque()  # (host slots, pages on their way)
        # Per step with loads, oldest first: its (device blocks, pages on their way) parts.
        self._arriving: deque[list[tuple[np.ndarray, tuple[jax.Array, ...]]]] = deque()
        self._written = 0  # steps whose loads are written into the cache
        self.stats = HostKVStats()

    def check(self, transfers: KVTransfers) -> None:
        """A ValueError (nothing changed) for a block or slot outside the cache or the pool."""
        num_slots = len(self.pool[0])
        for name, pairs, (blocks, slots) in (("saves", transfers.saves, (0, 1)), ("loads", transfers.loads, (1, 0))):
            for pair in pairs:
                if not (0 <= pair[blocks] < self.num_blocks and 0 <= pair[slots] < num_slots):
                    reject(f"kv_transfers.{name}: {tuple(pair)} is outside the {self.num_blocks} device blocks or "
                           f"the {num_slots} host slots")

    def arrived(self) -> int:
        """The steps with loads, counted from the first, whose blocks the next step writes before it
        runs (step 1): those written already, then those whose pages are all on the device. It only
        grows, so a request the scheduler admits on it finds its blocks written."""
        n = self._written
        for parts in self._arriving:
            if not all(page.is_ready() for _, pages in parts for page in pages):
                break
            n += 1
        return n

    def transfer(self, state: RunnerState, transfers: KVTransfers) -> RunnerState:
        """Steps 1-3 above; the state with the arrived loads written."""
        start = time.perf_counter()
        for _ in range(self.arrived() - self._written):
            for blocks, pages in self._arriving.popleft():
                state = self.programs.run(SCATTER_BLOCKS, state=state, blocks=blocks, pages=pages)
            self._written += 1
        if transfers.loads:
            parts = []
            slots, blocks = np.array(transfers.loads, np.int64).T
            self._land(set(slots.tolist()))
            for part in self._parts(len(slots)):
                n = bucket(part.stop - part.start, self.buckets)
                padded = np.full(n, self.num_blocks, np.int32)  # past the cache: the scatter drops them
                padded[: part.stop - part.start] = blocks[part]
                pages = [np.zeros((n, *pool.shape[1:]), pool.dtype) for pool in self.pool]
                for page, pool in zip(pages, self.pool):
                    page[: part.stop - part.start] = pool[slots[part]]
                parts.append((padded, tuple(jax.device_put(p, s) for p, s in zip(pages, self.shardings))))
            self._arriving.append(parts)
            self.stats.bytes_loaded += len(slots) * self.block_bytes
        if transfers.saves:
            blocks, slots = np.array(transfers.saves, np.int64).T
            for part in self._parts(len(slots)):
                padded = np.zeros(bucket(part.stop - part.start, self.buckets), np.int32)
                padded[: part.stop - part.start] = blocks[part]
                pages = self.programs.run(GATHER_BLOCKS, pages=(state.kv, state.draft_kv), blocks=padded)
                for page in pages:
                    page.copy_to_host_async()
                self._saving.append((slots[part], pages))
        self._land()
        self.stats.seconds += time.perf_counter() - start
        return state

    def _parts(self, n: int) -> list[slice]:
        most = self.buckets[-1]
        return [slice(i, min(i + most, n)) for i in range(0, n, most)]

    def _land(self, needed: set[int] = frozenset()) -> None:
        """Write the saves that have arrived into the pool, oldest first; those before and into a
        `needed` slot, waiting for them."""
        last_needed = max((i for i, (slots, _) in enumerate(self._saving) if needed & set(slots.tolist())), default=-1)
        while self._saving and (last_needed >= 0 or all(page.is_ready() for page in self._saving[0][1])):
            slots, pages = self._saving.popleft()
            for pool, page in zip(self.pool, pages):
                pool[slots] = np.asarray(page)[: len(slots)]
            self.stats.bytes_saved += len(slots) * self.block_bytes
            last_needed -= 1
