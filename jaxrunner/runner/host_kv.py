"""The bytes of the prefix cache's host tier: a pool of KV blocks in pinned host memory, and the
copies between it and the device's cache that each step's `KVTransfers` asks for. The books (which
block is in which slot) are the engine's (`engine.host_tier`); they rely on this order within a step:

  1. the earlier steps' loads that are on the device by now (`arrived`) are written into their
     blocks (SCATTER_BLOCKS) before anything of this step runs;
  2. this step's loads read their slots, and its saves are gathered from the cache (GATHER_BLOCKS),
     before the step's programs write it (`transfer`);
  3. once the step's programs are queued, the loads start their copies to the device (step 1 of a
     later step writes them) and the saves theirs into their slots (`start_copies`).

A slot holds one block as one array in pinned host memory, every page of it packed together
(`step.gather_blocks`): a copy each way per block, from and to memory the GPU's copy engines reach
directly, while the device computes; JAX orders a load after the save that filled its slot. Starting
a copy costs the host time per block, so the host starts them while the device runs the step, and
no step waits on a copy: the scheduler admits a request whose blocks are loading once `arrived`
counts them.
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
    seconds: float = 0.0  # host time the steps spent starting the copies


class HostKV:
    def __init__(self, ctx: Context, programs: Programs) -> None:
        self.programs = programs
        self.buckets = ctx.kv_transfer_buckets
        self.num_blocks = ctx.config.num_blocks
        block = ctx.packed_block
        self.device = block.sharding
        self.host = block.sharding.with_memory_kind("pinned_host")
        self.slots: list[jax.Array | None] = [None] * ctx.config.num_host_blocks  # a block each, once saved
        self.block_bytes = block.size
        self._padding = jax.device_put(np.zeros(block.shape, block.dtype), self.device)  # a bucket's unused rows
        self._reserve()
        # Per step with loads, oldest first: its (device blocks, packed blocks on their way) parts.
        self._arriving: deque[list[tuple[np.ndarray, tuple[jax.Array, ...]]]] = deque()
        self._written = 0  # steps whose loads are written into the cache
        self._loads: tuple[np.ndarray, list[jax.Array]] | None = None  # this step's: device blocks, their slots' arrays
        self._saves: list[tuple[list[int], tuple[jax.Array, ...]]] = []  # this step's: slots, gathered blocks
        self.stats = HostKVStats()

    def _reserve(self) -> None:
        """Have the host allocator pin the whole pool now: it pins memory as it grows, and a step
        whose saves grew it would wait for that (the allocator keeps what it pinned)."""
        filled = jax.device_put([self._padding] * len(self.slots), [self.host] * len(self.slots))
        jax.block_until_ready(filled)

    def check(self, transfers: KVTransfers) -> None:
        """A ValueError (nothing changed) for a block or slot outside the cache or the pool, or a load
        from a slot no save filled."""
        num_slots = len(self.slots)
        for name, pairs, (blocks, slots) in (("saves", transfers.saves, (0, 1)), ("loads", transfers.loads, (1, 0))):
            for pair in pairs:
                if not (0 <= pair[blocks] < self.num_blocks and 0 <= pair[slots] < num_slots):
                    reject(f"kv_transfers.{name}: {tuple(pair)} is outside the {self.num_blocks} device blocks or "
                           f"the {num_slots} host slots")
        for slot, _ in transfers.loads:
            if self.slots[slot] is None:
                reject(f"kv_transfers.loads: host slot {slot} holds no block (no earlier step saved one into it)")

    def arrived(self) -> int:
        """The steps with loads, counted from the first, whose blocks the next step writes before it
        runs (step 1): those written already, then those whose blocks are all on the device. It only
        grows, so a request the scheduler admits on it finds its blocks written."""
        n = self._written
        for parts in self._arriving:
            if not all(row.is_ready() for _, rows in parts for row in rows):
                break
            n += 1
        return n

    def transfer(self, state: RunnerState, transfers: KVTransfers) -> RunnerState:
        """Steps 1 and 2 above; the state with the arrived loads written."""
        start = time.perf_counter()
        for _ in range(self.arrived() - self._written):
            for blocks, rows in self._arriving.popleft():
                state = self.programs.run(SCATTER_BLOCKS, state=state, blocks=blocks, packed=rows)
            self._written += 1
        if transfers.loads:
            slots, blocks = np.array(transfers.loads, np.int64).T
            self._loads = (blocks, [self.slots[s] for s in slots.tolist()])
        for part in self._parts(len(transfers.saves)):
            blocks, slots = np.array(transfers.saves[part], np.int64).reshape(-1, 2).T
            rows = self.programs.run(GATHER_BLOCKS, pages=(state.kv, state.draft_kv), blocks=self._bucketed(blocks, 0))
            self._saves.append((slots.tolist(), rows[: len(blocks)]))
        self.stats.seconds += time.perf_counter() - start
        return state

    def start_copies(self) -> None:
        """Step 3 above: the copies that `transfer` prepared."""
        start = time.perf_counter()
        if self._loads is not None:
            blocks, held = self._loads
            loaded = jax.device_put(held, [self.device] * len(held))
            parts = []
            for part in self._parts(len(held)):
                padded = self._bucketed(blocks[part], self.num_blocks)  # past the cache: the scatter drops them
                parts.append((padded, tuple(loaded[part] + [self._padding] * (len(padded) - len(blocks[part])))))
            self._arriving.append(parts)
            self.stats.bytes_loaded += len(held) * self.block_bytes
            self._loads = None
        for slots, rows in self._saves:
            for slot, row in zip(slots, jax.device_put(list(rows), [self.host] * len(slots))):
                self.slots[slot] = row
            self.stats.bytes_saved += len(slots) * self.block_bytes
        self._saves = []
        self.stats.seconds += time.perf_counter() - start

    def _bucketed(self, blocks: np.ndarray, fill: int) -> np.ndarray:
        """`blocks` padded with `fill` to their copy bucket."""
        padded = np.full(bucket(len(blocks), self.buckets), fill, np.int32)
        padded[: len(blocks)] = blocks
        return padded

    def _parts(self, n: int) -> list[slice]:
        most = self.buckets[-1]
        return [slice(i, min(i + most, n)) for i in range(0, n, most)]
