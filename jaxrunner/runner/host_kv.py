"""The bytes of the prefix cache's host tier: a pool of KV blocks in pinned host memory, and the
copies between it and the device's cache that each step's `KVTransfers` asks for. The books (which
block is in which slot) are the engine's (`engine.host_tier`); they rely on this order within a step:

  1. the earlier steps' loads that are on the device by now are written into their blocks
     (SCATTER_BLOCKS) before anything of this step runs: each piece as it arrives, so that a
     request's whole load is not written in the step that admits it (`arrived`);
  2. this step's loads read their slots and start their copies to the device at once (step 1 of a
     later step writes them; a step's programs read none of them, so none waits), and its saves
     are gathered from the cache (GATHER_BLOCKS) before the step's programs write it (`transfer`);
  3. once the step's programs are queued and its output is on its way, the saves start their
     copies to the host, a few pieces a step (`start_copies`).

Blocks move in pieces: the engine packs the blocks a step saves in runs of a copy bucket's size
(`KVTransfers.saves`), and each, gathered from the cache (`step.gather_blocks`, up to eight of the
largest per program), is one array in pinned host memory; a slot is a row of one. A load copies
every piece that holds one of its slots whole, and the scatter drops the rows no slot of the load
asked for. Each copy costs the host a start and runs at the link's rate only when large, so a
prefix saved in a few steps comes back in a few copies, not one per block; they run beside the
device's programs, and no step waits on one: the scheduler admits a request whose blocks are
loading once `arrived` counts them. A piece lives while one of its rows is a slot's: the engine
evicts whole pieces (`KVTransfers.frees`), so the pool holds no more than its slots.

A step's output comes back through the same queue as the saves' copies, behind those started
before it; so a step starts SAVE_BYTES_PER_STEP of them, and the rest wait on the device, where a
load finds them too. They start sooner when they would hold more device memory than KV sizing set
aside for them (`LOADS_IN_FLIGHT_BYTES` with the loads on their way).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import jax
import numpy as np

from jaxrunner.runner.context import KV_TRANSFER_BYTES, LOADS_IN_FLIGHT_BYTES, PIECE_GROUPS, Context
from jaxrunner.runner.input_batch import bucket
from jaxrunner.runner.programs import GATHER_BLOCKS, SCATTER_BLOCKS, STACK_PIECES, Programs, piece_groups
from jaxrunner.runner.state import RunnerState
from jaxrunner.step_io import KVTransfers, reject


@dataclass
class HostKVStats:
    bytes_saved: int = 0  # device to host
    bytes_loaded: int = 0  # host to device: whole pieces, with the rows the loads did not ask for
    seconds: float = 0.0  # host time the steps spent starting the copies


Piece = jax.Array  # packed blocks [n, shards, bytes], n a copy bucket: in pinned host memory, on the device until sent
SAVE_BYTES_PER_STEP = 2 * KV_TRANSFER_BYTES  # the saves a step starts to the host: what the link moves in a short step


class HostKV:
    def __init__(self, ctx: Context, programs: Programs) -> None:
        self.programs = programs
        self.buckets = ctx.kv_transfer_buckets
        self.num_blocks = ctx.config.num_blocks
        block = ctx.packed_blocks(1)
        self.device = block.sharding
        self.host = block.sharding.with_memory_kind("pinned_host")
        self.slots: list[tuple[Piece, int] | None] = [None] * ctx.config.num_host_blocks  # (piece, row), once saved
        self.block_bytes = block.size
        self._most_waiting = LOADS_IN_FLIGHT_BYTES * block.shape[1]  # device bytes: saves not sent, loads arriving
        most = ctx.packed_blocks(self.buckets[-1])
        self._padding = jax.device_put(np.zeros(most.shape, np.uint8), self.device)  # fills a group of pieces
        self._reserve()
        # Per step with loads, oldest first: its pieces not written yet, as (device block per row, piece on its way).
        self._arriving: deque[list[tuple[np.ndarray, jax.Array]]] = deque()
        self._written = 0  # steps whose loads are written into the cache
        self._unsent: deque[tuple[list[int], jax.Array]] = deque()  # saves gathered, not sent: slots, their blocks
        self.stats = HostKVStats()
        self._groups = list(piece_groups(ctx))  # (blocks per piece, pieces) of each copy program

    def _reserve(self) -> None:
        """Have the host allocator pin the whole pool now: it pins memory as it grows, and a step
        whose saves grew it would wait for that (the allocator keeps what it pinned)."""
        count = -(-len(self.slots) // self.buckets[-1])
        jax.block_until_ready(jax.device_put([self._padding] * count, [self.host] * count))

    def run_each_once(self, state: RunnerState) -> RunnerState:
        """Run every copy program at least once, gathering the cache's first block and writing
        nothing back (every row dropped): a program's first run on the GPU holds the host far
        longer than later ones (its kernels load), and a revisit's steps would pay that."""
        for n, count in self._groups:
            gathered = self.programs.run(GATHER_BLOCKS, pages=(state.kv, state.draft_kv),
                                         blocks=np.zeros(n * count, np.int32), pieces=count)
            state = self._scatter(state, [(np.full(n, self.num_blocks, np.int32), piece) for piece in gathered])
        return jax.block_until_ready(state)

    def check(self, transfers: KVTransfers) -> None:
        """A ValueError (nothing changed) for a block or slot outside the cache or the pool, a save
        not in a piece of a copy bucket's size, or a load from a slot no save filled."""
        num_slots = len(self.slots)
        saves = [pair for piece in transfers.saves for pair in piece]
        for name, pairs, (blocks, slots) in (("saves", saves, (0, 1)), ("loads", transfers.loads, (1, 0))):
            for pair in pairs:
                if not (0 <= pair[blocks] < self.num_blocks and 0 <= pair[slots] < num_slots):
                    reject(f"kv_transfers.{name}: {tuple(pair)} is outside the {self.num_blocks} device blocks or "
                           f"the {num_slots} host slots")
        if not all(0 <= slot < num_slots for slot in transfers.frees):
            reject(f"kv_transfers.frees: {list(transfers.frees)[:5]} has slots outside the {num_slots} host slots")
        if sizes := [len(piece) for piece in transfers.saves if len(piece) not in self.buckets]:
            reject(f"kv_transfers.saves: pieces of {sizes} blocks; this runner copies pieces of {list(self.buckets)}")
        for slot, _ in transfers.loads:
            if self.slots[slot] is None:
                reject(f"kv_transfers.loads: host slot {slot} holds no block (no earlier step saved one into it)")

    def arrived(self) -> int:
        """The steps with loads, counted from the first, whose blocks the next step has written
        before it runs (step 1): those written already, then those whose pieces are all on the
        device. It only grows, so a request the scheduler admits on it finds its blocks written."""
        n = self._written
        for pieces in self._arriving:
            if not all(piece.is_ready() for _, piece in pieces):
                break
            n += 1
        return n

    def transfer(self, state: RunnerState, transfers: KVTransfers) -> RunnerState:
        """Steps 1 and 2 above; the state with the arrived pieces written."""
        start = time.perf_counter()
        state = self._write_arrived(state)
        pieces: dict[int, tuple[np.ndarray, Piece]] = {}
        for slot, block in transfers.loads:
            piece, row = self.slots[slot]
            blocks, _ = pieces.setdefault(id(piece), (np.full(piece.shape[0], self.num_blocks, np.int32), piece))
            blocks[row] = block  # the rest stay past the cache: the scatter drops them
        self._start_loads(list(pieces.values()))
        for slot in transfers.frees:
            self.slots[slot] = None
        for group in self._gather_groups(transfers.saves):
            blocks = np.array([block for piece in group for block, _ in piece], np.int32)
            gathered = self.programs.run(GATHER_BLOCKS, pages=(state.kv, state.draft_kv), blocks=blocks,
                                         pieces=len(group))
            for piece, packed in zip(group, gathered):
                slots = [slot for _, slot in piece]
                for row, slot in enumerate(slots):
                    self.slots[slot] = (packed, row)
                self._unsent.append((slots, packed))
        self.stats.seconds += time.perf_counter() - start
        return state

    def _gather_groups(self, saves: tuple) -> list[list]:
        """The step's pieces as the gathers take them: the largest in groups of PIECE_GROUPS's sizes,
        largest first (none padded: a padding piece would hold device memory), each other alone."""
        most = self.buckets[-1]
        largest, groups = [piece for piece in saves if len(piece) == most], []
        for size in reversed(PIECE_GROUPS):
            while len(largest) >= size:
                groups.append(largest[:size])
                largest = largest[size:]
        return groups + [[piece] for piece in saves if len(piece) != most]

    def _start_loads(self, loads: list[tuple[np.ndarray, Piece]]) -> None:
        """Start the copies of `loads` (device block per row, piece) to the device."""
        if loads:
            loaded = jax.device_put([piece for _, piece in loads], [self.device] * len(loads))
            self._arriving.append([(blocks, piece) for (blocks, _), piece in zip(loads, loaded)])
            self.stats.bytes_loaded += sum(piece.nbytes for _, piece in loads if piece.sharding == self.host)

    def start_copies(self) -> None:
        """Step 3 above: the saves that `transfer` gathered."""
        start = time.perf_counter()
        self._send()
        self.stats.seconds += time.perf_counter() - start

    def _send(self) -> None:
        """Start the oldest saves' copies to the host: SAVE_BYTES_PER_STEP of them, or more while
        those waiting and the loads on their way hold more than `_most_waiting`. A piece no slot
        holds any more is dropped unsent."""
        waiting = sum(piece.nbytes for _, piece in self._unsent)
        waiting += sum(piece.nbytes for pieces in self._arriving for _, piece in pieces)
        sending, budget = [], SAVE_BYTES_PER_STEP
        while self._unsent and (budget > 0 or waiting > self._most_waiting):
            slots, packed = self._unsent.popleft()
            waiting -= packed.nbytes
            if any(self._holds(slot, packed) for slot in slots):
                sending.append((slots, packed))
                budget -= packed.nbytes
        if not sending:
            return
        held = jax.device_put([packed for _, packed in sending], [self.host] * len(sending))
        for (slots, packed), piece in zip(sending, held):
            for row, slot in enumerate(slots):
                if self._holds(slot, packed):
                    self.slots[slot] = (piece, row)
            self.stats.bytes_saved += piece.nbytes

    def _holds(self, slot: int, packed: jax.Array) -> bool:
        """Whether `slot` still holds a row of `packed` (not freed, nor saved into again since)."""
        return self.slots[slot] is not None and self.slots[slot][0] is packed

    def _write_arrived(self, state: RunnerState) -> RunnerState:
        """Every piece on the device by now written into its blocks, up to PIECE_GROUPS's largest
        count per program; then the steps all of whose pieces are written are done."""
        ready = []
        for pieces in self._arriving:
            waiting = []
            for blocks, piece in pieces:
                (ready if piece.is_ready() else waiting).append((blocks, piece))
            pieces[:] = waiting
        for i in range(0, len(ready), PIECE_GROUPS[-1]):
            state = self._scatter(state, ready[i : i + PIECE_GROUPS[-1]])
        while self._arriving and not self._arriving[0]:
            self._arriving.popleft()
            self._written += 1
        return state

    def _scatter(self, state: RunnerState, pieces: list[tuple[np.ndarray, jax.Array]]) -> RunnerState:
        """One program writing `pieces` (up to PIECE_GROUPS's largest count, of any sizes): each
        smaller than the largest is padded to it first (`step.stack_pieces`), and the group is
        padded to a count of PIECE_GROUPS, its padding rows dropped."""
        most = self.buckets[-1]
        group = [(np.pad(blocks, (0, most - len(blocks)), constant_values=self.num_blocks),
                  piece if len(blocks) == most else self.programs.run(STACK_PIECES, packed=(piece,), rows=most))
                 for blocks, piece in pieces]
        group += [(np.full(most, self.num_blocks, np.int32), self._padding)] * (bucket(len(group), PIECE_GROUPS) - len(group))
        rows = self.programs.run(STACK_PIECES, packed=tuple(piece for _, piece in group), rows=most)
        return self.programs.run(SCATTER_BLOCKS, state=state, blocks=np.concatenate([b for b, _ in group]), rows=rows)
