"""The host tier of the prefix cache: which evicted KV blocks a pool in host memory holds.

The block manager hands a cached block to `offload` when it evicts it from the device; the block
then lives on in a host slot under the same key (KV-cache group, block hash), in LRU order, until
the pool needs the slot. A prefix that the device no longer holds but the host does is `find`-able,
and `load` copies it back into a fresh device block. This side keeps only the books: the copies
themselves are the runner's (`runner.host_kv`), told by each step's `KVTransfers`, which `take`
empties. A step's loads are one batch; `arrived()` counts the batches (in order) whose blocks are
written by the step the scheduler is about to make, so a request reads its blocks no sooner (the
runner's count, or by default every batch but this step's). It is the seam for other tiers
(another process, a disk): the same five calls.

A slot saved by this step holds its block only once the runner has copied it, which it does after
it reads the step's loads; so a key saved in this step is not found until the next one.

Loaded blocks take device memory on their way (the copies, and the cached blocks their fresh
blocks evict, gathered for their saves), which KV sizing sets aside for `max_loads` blocks in
flight at once (`in_flight_bytes`); `room()` is what the scheduler may still load.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from jaxrunner.step_io import KVTransfers

Key = tuple[int, bytes]  # (KV-cache group, block hash): the prefix cache's key
LOADS_IN_FLIGHT_BYTES = 2 << 30  # the device bytes of the blocks that may be loading at once


def max_loads(block_bytes: int) -> int:
    """Blocks of `block_bytes` (every device's share) that may be loading at once."""
    return max(1, LOADS_IN_FLIGHT_BYTES // block_bytes)


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
    def __init__(self, num_slots: int, arrived: Callable[[], int] | None = None, max_loads: int | None = None) -> None:
        if num_slots < 1:
            raise ValueError(f"a host tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.max_loads = max_loads or num_slots  # blocks loading at once
        self.batches = 0  # load batches taken so far
        self.arrived = arrived or (lambda: self.batches)
        self._in_flight: list[tuple[int, int]] = []  # (batch, blocks) of the batches taken, not arrived
        self.slots: OrderedDict[Key, int] = OrderedDict()  # least recently used first
        self._free = list(range(num_slots - 1, -1, -1))
        self._saves: dict[int, int] = {}  # this step's: host slot -> device block (a later save of a slot wins)
        self._loads: list[tuple[int, int]] = []  # this step's: (host slot, device block)
        self.stats = HostTierStats()

    def find(self, key: Key) -> int | None:
        """The slot holding `key`'s block, if the host has it (and not only from this step); a
        block found is used again last."""
        slot = self.slots.get(key)
        if slot is None or slot in self._saves:
            return None
        self.slots.move_to_end(key)
        return slot

    def offload(self, block: int, key: Key) -> None:
        """Keep the device block `block`, evicted from the device under `key`, in a host slot (the
        least recently used one's when the pool is full)."""
        if key in self.slots:
            self.slots.move_to_end(key)
            return
        if self._free:
            slot = self._free.pop()
        else:
            _, slot = self.slots.popitem(last=False)
        self.slots[key] = slot
        self._saves[slot] = block
        self.stats.blocks_saved += 1

    def load(self, slot: int, block: int) -> None:
        """Copy the slot (as `find` gave it) into the device block `block` (it arrives by a later
        step, `arrived`). The runner reads this step's loads before it writes its saves, so the
        slot may be given to a save meanwhile."""
        self._loads.append((slot, block))
        self.stats.blocks_loaded += 1

    def room(self) -> int:
        """Blocks this step may still load: `max_loads` less those on their way and this step's."""
        arrived = self.arrived()
        self._in_flight = [(batch, n) for batch, n in self._in_flight if batch > arrived]
        return self.max_loads - sum(n for _, n in self._in_flight) - len(self._loads)

    def take(self) -> KVTransfers:
        """This step's copies, for its SchedulerOutput (its loads are batch `batches`, counted from 1);
        the next step starts with none."""
        transfers = KVTransfers(tuple((block, slot) for slot, block in self._saves.items()), tuple(self._loads))
        self._saves, self._loads = {}, []
        if transfers.loads:
            self.batches += 1
            self._in_flight.append((self.batches, len(transfers.loads)))
        return transfers
