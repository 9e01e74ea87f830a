"""The KV block manager: which cache blocks each request owns, and the prefix cache.

Blocks come from a free queue and carry reference counts, so one block can back several requests
that share a prefix (n > 1, shared system prompts). A block that is full is registered under a
chained hash of its tokens (the hash of the block before it, then its own token ids), so a later
request with the same prefix (and the same LoRA adapter) finds it. Freed blocks keep their hash and stay findable until the
allocator needs them: the free queue is in LRU order (front is evicted first), which is vLLM v1's
prefix caching.

A block is registered when the step that computes its KV is scheduled, not after it ran. Another
request admitted in the same step may then hit it; that is safe because the runner writes every
token's KV of a layer before any attention of that layer reads the cache.

A model with several KV-cache groups (`ModelConfig.kv_cache_groups`: Gemma's sliding and full layers)
gets one list of blocks per group per request, all from the one pool. A sliding group gives back
the blocks its window has passed (keeping them findable), so a long request holds its whole length
only in the full groups; the entries given back point at the null block, reserved for that. A
prefix hit must then hold, in every sliding group, the blocks of the window before the hit.

With a host tier (`host_tier.HostTier`), a cached block that the free queue evicts is copied to
host memory first, and a prefix hit may continue there: each such block (a `HostBlock` among the
hits) gets a fresh device block that the runner copies it into. Those blocks are registered only
by the request's next allocation, which the scheduler makes once they have arrived
(`Scheduler.loading`), so no request reads them sooner.
"""

from __future__ import annotations

import hashlib
from array import array
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from jaxrunner.engine.host_tier import HostTier
from jaxrunner.engine.request import Request


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Identity of a full block: its tokens and, through `parent`, every token before them."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


@dataclass
class PrefixCacheStats:
    """Counted once per request, at its first admission and the parts of its hit that follow it
    (resumed requests would inflate hits)."""

    requests: int = 0
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


NULL_BLOCK = 0  # what a sliding group's given-back entries point at: never allocated, never written


@dataclass(frozen=True)
class HostBlock:
    """A prefix-cache hit in the host tier's `slot`: it needs a device block to be copied into."""

    slot: int


def num_loads(hits: Sequence[Sequence[int | HostBlock]]) -> int:
    return sum(isinstance(b, HostBlock) for hit in hits for b in hit)


def blocks_to_hold(num_tokens: int, block_size: int, windows: Sequence[int | None], chunk: int, lookbehind: int = 0) -> int:
    """The most blocks, over all groups, that one request of `num_tokens` tokens holds at once
    when a step computes at most `chunk` of its tokens (`lookbehind`: as `BlockManager`'s)."""
    full = -(-num_tokens // block_size)
    return sum(full if w is None else min(full, -(-(w - 1 + lookbehind + chunk) // block_size) + 1) for w in windows)


def null_blocks(windows: Sequence[int | None]) -> int:
    """1 when a group slides (NULL_BLOCK is then reserved), else 0."""
    return int(any(w is not None for w in windows))


class BlockManager:
    """`ref_counts[b]` counts the requests holding block b; `free_queue` holds exactly the blocks
    with count 0, least recently freed first; `cached` maps (group, block hash) to its block.

    `windows`: the sliding window of each KV-cache group (None: full attention). `lookbehind`: the
    tokens a sliding group keeps before its window as well, for a step whose computed count is an
    upper bound (speculative decoding counts every draft in flight as accepted). `host_tier`: where
    evicted cached blocks go, and where a prefix hit continues (None: nowhere).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 windows: Sequence[int | None] = (None,), lookbehind: int = 0, host_tier: HostTier | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.windows = tuple(windows)
        self.lookbehind = lookbehind
        self.host_tier = host_tier if enable_caching else None
        self.num_reserved = null_blocks(self.windows)
        if num_blocks <= self.num_reserved:
            raise ValueError(f"num_blocks={num_blocks} leaves no block to allocate")
        self.ref_counts = [0] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.num_reserved, num_blocks))
        self.cached: dict[tuple[int, bytes], int] = {}
        self.block_hash: list[tuple[int, bytes] | None] = [None] * num_blocks
        self.req_blocks: dict[str, list[list[int]]] = {}
        self.parked: dict[int, list[list[int]]] = {}  # blocks held for no request (`park`)
        self._num_registered: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / (self.num_blocks - self.num_reserved)

    def block_ids(self, req_id: str) -> tuple[list[int], ...]:
        """The request's blocks, one list per group."""
        return tuple(map(list, self.req_blocks.get(req_id, [[] for _ in self.windows])))

    def get_computed_blocks(self, request: Request, max_loads: int | None = None,
                            start: int = 0) -> tuple[tuple[list[int | HostBlock], ...], int]:
        """Cached blocks (per group) that start the request's tokens, and how many tokens they cover;
        those only the host tier holds are `HostBlock`s, moving at most `max_loads` rows (a shorter hit).
        `start`: the blocks of a hit that the request holds already (one the bound on loads cut):
        the blocks after them, and the tokens that the whole hit covers.

        The last token is always left to compute (the runner needs its logits), so a prompt that is
        entirely cached still runs one token, as in vLLM. A request asking for prompt logprobs gets
        no hits (it still fills the cache): the runner scores only the positions it computes. A hit
        of n blocks needs, in every group, the blocks the next token's attention reads; a sliding
        group's entries before its window are the null block.
        """
        none = tuple([] for _ in self.windows)
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return none, 0
        hashes = self._hashes(request, (request.num_tokens - 1) // self.block_size)
        runs = [self._cached_runs(g, hashes) for g in range(len(self.windows))]
        # Per group, the host slot of each block only the host tier holds (when the loads are capped).
        host = [[None if (g, h) in self.cached else self.host_tier.peek((g, h)) for h in hashes]
                for g in range(len(runs))] if max_loads is not None else []
        n, last = len(hashes), -1
        while n != last:  # each group's longest hit within the others' (and the loads'); shrinks to a common one
            last = n
            for g, run in enumerate(runs):
                while n > start and run[n - 1] < n - self._first_held(g, n, start):
                    n -= 1
            if max_loads is not None:
                n = bisect_right(range(n + 1), False, lo=start,
                                 key=lambda m: self._load_rows(host, m, start) > max_loads) - 1
        if n <= start:
            return none, start * self.block_size
        hits = tuple(
            [NULL_BLOCK] * ((first := self._first_held(g, n, start)) - start)
            + [self._lookup((g, h)) for h in hashes[first:n]]
            for g in range(len(self.windows))
        )
        return hits, n * self.block_size

    def _first_held(self, group: int, n: int, start: int) -> int:
        """The first block of a hit of `n` blocks past `start` that the group's next token reads."""
        return max(start, self._first_needed(group, n * self.block_size))

    def _load_rows(self, host: list[list[int | None]], n: int, start: int) -> int:
        """The rows that a hit of `n` blocks past `start` loads, from `host`'s slots."""
        return self.host_tier.rows(slot for g, slots in enumerate(host)
                                   for slot in slots[self._first_held(g, n, start) : n] if slot is not None)

    def load_rows(self, hits: Sequence[Sequence[int | HostBlock]]) -> int:
        """The rows that the hits' host blocks move (`HostTier.rows`: their pieces, whole)."""
        return self.host_tier.rows(b.slot for hit in hits for b in hit if isinstance(b, HostBlock))

    def _lookup(self, key: tuple[int, bytes]) -> int | HostBlock:
        """A cached block: the device's, else the host tier's (`_cached_runs` found it in one)."""
        block = self.cached.get(key)
        return block if block is not None else HostBlock(self.host_tier.find(key))

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[Sequence[int | HostBlock]] = ()
    ) -> tuple[list[int], ...] | None:
        """Give the request blocks for `num_new_tokens` more tokens; the fresh block ids per group,
        or None (nothing changed but the first release below) when the free queue cannot supply them.

        `computed_blocks` are prefix-cache hits from `get_computed_blocks`, for a request that holds
        no blocks yet, or the rest of a hit that the bound on loads cut (after the blocks the request
        holds); they come after the tokens counted in `request.num_computed_tokens`. Each
        `HostBlock` among them takes a fresh block that the host tier loads; the request's blocks are
        then registered by its next allocation, once they have arrived. The sliding groups give back
        the blocks their windows no longer reach: those behind the computed tokens' window first, those
        behind the hit's only once the hit's blocks are the request's (a request whose next part of a
        hit cannot be taken computes from where it is, and needs that window).
        """
        blocks = self.req_blocks.setdefault(request.req_id, [[] for _ in self.windows])
        first_allocation = not blocks[0]
        hits = computed_blocks or tuple([] for _ in self.windows)
        num_hit_tokens = len(hits[0]) * self.block_size
        start = request.num_computed_tokens + num_hit_tokens
        total = start + num_new_tokens
        for g in range(len(self.windows)):
            self._release_behind(blocks[g], self._first_needed(g, request.num_computed_tokens))
        length = -(-total // self.block_size)
        needed = [max(length - len(held) - len(hit), 0) for held, hit in zip(blocks, hits)]
        on_device = [b for hit in hits for b in hit if not isinstance(b, HostBlock) and b >= self.num_reserved]
        num_loads = sum(isinstance(b, HostBlock) for hit in hits for b in hit)
        if sum(needed) + num_loads > len(self.free_queue) - sum(self.ref_counts[b] == 0 for b in on_device):
            if first_allocation:
                del self.req_blocks[request.req_id]
            return None
        for g in range(len(self.windows)):
            self._release_behind(blocks[g], self._first_needed(g, start))
        for block in on_device:
            if self.ref_counts[block] == 0:
                del self.free_queue[block]
            self.ref_counts[block] += 1
        for held, hit in zip(blocks, hits):
            held += [self._load(b) if isinstance(b, HostBlock) else b for b in hit]
        fresh = tuple([self._pop_free() for _ in range(n)] for n in needed)
        for held, more in zip(blocks, fresh):
            held += more
        if self.enable_caching and request.num_preemptions == 0:
            if first_allocation:
                self.stats.requests += 1
                self.stats.queries += request.num_tokens
            self.stats.hits += num_hit_tokens
            if num_loads:
                loaded = {i for hit in hits for i, b in enumerate(hit) if isinstance(b, HostBlock)}
                self.host_tier.stats.hits += len(loaded) * self.block_size
        if self.enable_caching and not num_loads:
            self._register_full_blocks(request, blocks, min(total, request.num_tokens) // self.block_size)
        return fresh

    def _load(self, hit: HostBlock) -> int:
        """A fresh device block that the host tier copies `hit` into."""
        block = self._pop_free()
        self.host_tier.load(hit.slot, block)
        return block

    def free(self, request: Request) -> None:
        """Release the request's blocks; the tail goes to the front of the queue (evicted first),
        since a shared prefix is likelier to be reused than a request's private tail."""
        for held in self.req_blocks.pop(request.req_id, []):
            for block in reversed(held):
                self._release(block)
        self._num_registered.pop(request.req_id, None)

    def park(self, request: Request) -> int:
        """Hold the request's blocks for no request (its id may come back) until `unpark`: those
        of a request that ended while the host tier's copies into them are on their way."""
        token = max(self.parked, default=-1) + 1
        self.parked[token] = self.req_blocks.pop(request.req_id)
        self._num_registered.pop(request.req_id, None)
        return token

    def unpark(self, token: int) -> None:
        for held in self.parked.pop(token):
            for block in reversed(held):
                self._release(block)

    def _first_needed(self, group: int, num_computed: int) -> int:
        """The first block the group's attention still reads once `num_computed` tokens are computed."""
        window = self.windows[group]
        return 0 if window is None else max(0, num_computed - window + 1 - self.lookbehind) // self.block_size

    def _release(self, block: int) -> None:
        if block < self.num_reserved:
            return
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_queue[block] = None

    def _release_behind(self, held: list[int], first: int) -> None:
        """Give back a sliding group's blocks before `first`; those already given back (the null
        block) are a prefix, so the walk stops at the first of them."""
        for i in range(min(first, len(held)) - 1, -1, -1):
            if held[i] < self.num_reserved:
                break
            self._release(held[i])
            held[i] = NULL_BLOCK

    def _cached_runs(self, group: int, hashes: list[bytes]) -> list[int]:
        """run[i]: how many blocks up to block i (included) the group has cached, back to back."""
        runs, run = [], 0
        for h in hashes:
            run = run + 1 if (group, h) in self.cached or self._in_host((group, h)) else 0
            runs.append(run)
        return runs

    def _in_host(self, key: tuple[int, bytes]) -> bool:
        return self.host_tier is not None and self.host_tier.peek(key) is not None

    def _pop_free(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        old_key = self.block_hash[block]
        if old_key is not None:
            del self.cached[old_key]
            self.block_hash[block] = None
            if self.host_tier is not None:
                self.host_tier.offload(block, old_key)
        self.ref_counts[block] = 1
        return block

    def _hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """The first `num_blocks` block hashes of the request, extending its lazily built list."""
        hashes, bs = request.block_hashes, self.block_size
        if len(hashes) < num_blocks:
            tokens = request.all_token_ids
            lora = request.lora_request
            first = b"" if lora is None else b"lora:%d" % lora.lora_int_id  # an adapter's KV is its own
            for i in range(len(hashes), num_blocks):
                hashes.append(hash_block(hashes[-1] if hashes else first, tokens[i * bs : (i + 1) * bs]))
        return hashes[:num_blocks]

    def _register_full_blocks(self, request: Request, blocks: list[list[int]], num_full: int) -> None:
        """Make the request's full blocks findable; a block whose content is already cached stays private."""
        start = self._num_registered.get(request.req_id, 0)
        if num_full <= start:
            return
        hashes = self._hashes(request, num_full)[start:]
        for g, held in enumerate(blocks):
            for block, block_hash in zip(held[start:num_full], hashes):
                key = (g, block_hash)
                if block >= self.num_reserved and self.block_hash[block] is None and key not in self.cached:
                    self.cached[key] = block
                    self.block_hash[block] = key
        self._num_registered[request.req_id] = num_full
