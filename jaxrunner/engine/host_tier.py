"""The host tier of the prefix cache: which evicted KV blocks a pool in host memory holds.

The block manager hands a cached block to `offload` when it evicts it from the device; the block
then lives on in a host slot under the same key (KV-cache group, block hash) until the pool needs
the slot. A prefix that the device no longer holds but the host does is `find`-able, and `load`
copies it back into a fresh device block. This side keeps only the books: the copies themselves
are the runner's (`runner.host_kv`), told by each step's `KVTransfers`, which `take` empties. A
step's loads are one batch; `arrived()` counts the batches (in order) whose blocks are written by
the step the scheduler is about to make, so a request reads its blocks no sooner (the runner's
count, or by default every batch but this step's). It is the seam for other tiers (another
process, a disk): the same calls (`find`/`peek`, `offload`, `load`, `take`, `arrived`, and `rows`
and `room` for the bound on loads).

The pool's unit is a piece: the blocks a step saves are packed in runs of `piece_sizes` (the
runner's copy buckets, largest first), and the host holds and copies each run as one array. So
the LRU order is the pieces', a `find` makes its block's piece the most recent, and the pool
evicts a whole piece at once (its slots are `frees` for the runner): a piece one of whose rows
still held a block would keep all its memory, and the pool would hold more than its size. A load
moves the pieces its slots are in, whole, and `rows` counts what it moves.

A slot saved by this step holds its block only once the runner has copied it, which it does after
it reads the step's loads; so a key saved in this step is not found until the next one.

Loaded blocks take device memory on their way (the copies, and the cached blocks their fresh
blocks evict, gathered for their saves), which KV sizing sets aside for `max_loads` blocks in
flight at once (`in_flight_bytes`); `room()` is what the scheduler may still load, in the rows of
the pieces on their way.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from jaxrunner.runner.context import KV_TRANSFER_BYTES, LOADS_IN_FLIGHT_BYTES
from jaxrunner.step_io import KVTransfers

Key = tuple[int, bytes]  # (KV-cache group, block hash): the prefix cache's key


def max_loads(block_bytes: int) -> int:
    """Rows of `block_bytes` (every device's share) that may be loading at once: LOADS_IN_FLIGHT_BYTES
    of them, and the two pieces at a prefix's ends, which it may share with other blocks and a load
    moves whole."""
    return max(1, (LOADS_IN_FLIGHT_BYTES + 2 * KV_TRANSFER_BYTES) // block_bytes)


def in_flight_bytes(block_bytes: int, step_blocks: int) -> int:
    """Device bytes a host tier's copies may hold at once: `max_loads` blocks loading, as many
    evicted for them and gathered for their saves, and the saves of the `step_blocks` a step may
    allocate for its tokens."""
    return (2 * max_loads(block_bytes) + step_blocks) * block_bytes


@dataclass
class HostTierStats:
    hits: int = 0  # prompt tokens found in the host tier
    blocks_saved: int = 0
    blocks_loaded: int = 0


class HostTier:
    def __init__(self, num_slots: int, arrived: Callable[[], int] | None = None, max_loads: int | None = None,
                 piece_sizes: tuple[int, ...] = (1,)) -> None:
        if num_slots < 1:
            raise ValueError(f"a host tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.max_loads = max_loads or num_slots  # rows loading at once
        self.piece_sizes = piece_sizes
        self.batches = 0  # load batches taken so far
        self.arrived = arrived or (lambda: self.batches)
        self._in_flight: list[tuple[int, int]] = []  # (batch, rows) of the batches taken, not arrived
        self.slots: dict[Key, int] = {}  # every key the pool holds, this step's saves too
        self._keys: dict[int, Key] = {}  # the other way
        self._pieces: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # piece -> its slots, least recently used first
        self._piece_of: dict[int, int] = {}  # slot -> piece, once saved
        self._next_piece = 0
        self._free = list(range(num_slots - 1, -1, -1))
        self._saves: dict[int, int] = {}  # this step's: host slot -> device block
        self._frees: list[int] = []  # this step's: the slots of the pieces evicted
        self._evicted: dict[int, tuple[int, int]] = {}  # this step's: slot -> (piece, rows), for its loads
        self._loads: list[tuple[int, int]] = []  # this step's: (host slot, device block)
        self._loading: dict[int, int] = {}  # this step's: the pieces its loads move -> their rows
        self.stats = HostTierStats()

    def find(self, key: Key) -> int | None:
        """The slot holding `key`'s block, if the host has it (and not only from this step); its
        piece is used again last."""
        if (slot := self.peek(key)) is not None:
            self._pieces.move_to_end(self._piece_of[slot])
        return slot

    def peek(self, key: Key) -> int | None:
        """`find` without using the block."""
        slot = self.slots.get(key)
        return None if slot is None or slot in self._saves else slot

    def offload(self, block: int, key: Key) -> None:
        """Keep the device block `block`, evicted from the device under `key`, in a host slot (when
        the pool is full, the least recently used piece gives its slots up)."""
        if (slot := self.slots.get(key)) is not None:
            if slot in self._piece_of:
                self._pieces.move_to_end(self._piece_of[slot])
            return
        slot = self._free.pop() if self._free else self._evict()
        self.slots[key], self._keys[slot] = slot, key
        self._saves[slot] = block
        self.stats.blocks_saved += 1

    def _evict(self) -> int:
        """A slot for a save: the least recently used piece's, all of whose slots are then free; in a
        pool that this step's saves fill, the step's oldest save's."""
        if self._pieces:
            _, slots = self._pieces.popitem(last=False)
            for slot in slots:
                del self.slots[self._keys.pop(slot)]
                self._evicted[slot] = (self._piece_of.pop(slot), len(slots))
            self._frees += slots
            self._free += slots
            return self._free.pop()
        slot = next(iter(self._saves))
        del self.slots[self._keys.pop(slot)], self._saves[slot]
        return slot

    def load(self, slot: int, block: int) -> None:
        """Copy the slot (as `find` gave it) into the device block `block` (it arrives by a later
        step, `arrived`). The runner reads this step's loads before it writes its saves, so the
        slot, or its whole piece, may be evicted meanwhile."""
        self._loads.append((slot, block))
        piece, rows = self._piece(slot)
        self._loading[piece] = rows
        self.stats.blocks_loaded += 1

    def rows(self, slots: Iterable[int]) -> int:
        """The rows that loading `slots` would move beside this step's loads: their pieces', whole."""
        pieces = dict(map(self._piece, slots))
        return sum(rows for piece, rows in pieces.items() if piece not in self._loading)

    def _piece(self, slot: int) -> tuple[int, int]:
        """The piece holding the slot's block (as found this step), and its rows."""
        if slot in self._piece_of:
            return self._piece_of[slot], len(self._pieces[self._piece_of[slot]])
        return self._evicted[slot]

    def room(self) -> int:
        """Rows this step may still load: `max_loads` less those on their way and this step's."""
        arrived = self.arrived()
        self._in_flight = [(batch, n) for batch, n in self._in_flight if batch > arrived]
        return self.max_loads - sum(n for _, n in self._in_flight) - sum(self._loading.values())

    def take(self) -> KVTransfers:
        """This step's copies, for its SchedulerOutput (its loads are batch `batches`, counted from 1);
        the next step starts with none. The saves become pieces, the most recently used."""
        saves, pieces = list(self._saves.items()), []
        for n in self._runs(len(saves)):
            run, saves = saves[:n], saves[n:]
            self._pieces[self._next_piece] = tuple(slot for slot, _ in run)
            self._piece_of.update((slot, self._next_piece) for slot, _ in run)
            self._next_piece += 1
            pieces.append(tuple((block, slot) for slot, block in run))
        transfers = KVTransfers(tuple(pieces), tuple(self._loads), tuple(self._frees))
        if transfers.loads:
            self.batches += 1
            self._in_flight.append((self.batches, sum(self._loading.values())))
        self._saves, self._frees, self._evicted, self._loads, self._loading = {}, [], {}, [], {}
        return transfers

    def _runs(self, n: int) -> list[int]:
        """`n` blocks as pieces, largest first: as many of the largest size as fit, then the binary
        digits of the rest (the sizes are powers of two from 1), so that no piece holds padding."""
        most = self.piece_sizes[-1]
        rest = n % most
        return [most] * (n // most) + [size for size in reversed(self.piece_sizes) if rest & size]
