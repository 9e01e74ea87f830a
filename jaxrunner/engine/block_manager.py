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
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from jaxrunner.engine.request import Request


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Identity of a full block: its tokens and, through `parent`, every token before them."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


@dataclass
class PrefixCacheStats:
    """Counted once per request, at its first admission (resumed requests would inflate hits)."""

    requests: int = 0
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockManager:
    """`ref_counts[b]` counts the requests holding block b; `free_queue` holds exactly the blocks
    with count 0, least recently freed first; `cached` maps a block hash to its block."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.req_blocks: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def block_ids(self, req_id: str) -> list[int]:
        return list(self.req_blocks.get(req_id, ()))

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Cached blocks that start the request's tokens, and how many tokens they cover.

        The last token is always left to compute (the runner needs its logits), so a prompt that is
        entirely cached still runs one token, as in vLLM. A request asking for prompt logprobs gets
        no hits (it still fills the cache): the runner scores only the positions it computes.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        hits = []
        for block_hash in self._hashes(request, (request.num_tokens - 1) // self.block_size):
            block = self.cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()
    ) -> list[int] | None:
        """Give the request blocks for `num_new_tokens` more tokens; the fresh block ids, or None
        (nothing changed) when the free queue cannot supply them.

        `computed_blocks` are prefix-cache hits from `get_computed_blocks`, for a request that holds
        no blocks yet; they come before the tokens counted in `request.num_computed_tokens`.
        """
        blocks = self.req_blocks.setdefault(request.req_id, [])
        first_allocation = not blocks
        num_hit_tokens = len(computed_blocks) * self.block_size
        total = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        needed = max(-(-total // self.block_size) - len(blocks) - len(computed_blocks), 0)
        hits_in_queue = sum(1 for b in computed_blocks if self.ref_counts[b] == 0)
        if needed > len(self.free_queue) - hits_in_queue:
            if first_allocation:
                del self.req_blocks[request.req_id]
            return None
        for block in computed_blocks:
            if self.ref_counts[block] == 0:
                del self.free_queue[block]
            self.ref_counts[block] += 1
        fresh = [self._pop_free() for _ in range(needed)]
        blocks += list(computed_blocks) + fresh
        if first_allocation and self.enable_caching and request.num_preemptions == 0:
            self.stats.requests += 1
            self.stats.queries += request.num_tokens
            self.stats.hits += num_hit_tokens
        if self.enable_caching:
            self._register_full_blocks(request, blocks, min(total, request.num_tokens) // self.block_size)
        return fresh

    def free(self, request: Request) -> None:
        """Release the request's blocks; the tail goes to the front of the queue (evicted first),
        since a shared prefix is likelier to be reused than a request's private tail."""
        for block in reversed(self.req_blocks.pop(request.req_id, [])):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None
        self._num_registered.pop(request.req_id, None)

    def _pop_free(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        old_hash = self.block_hash[block]
        if old_hash is not None:
            del self.cached[old_hash]
            self.block_hash[block] = None
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

    def _register_full_blocks(self, request: Request, blocks: list[int], num_full: int) -> None:
        """Make the request's full blocks findable; a block whose content is already cached stays private."""
        start = self._num_registered.get(request.req_id, 0)
        if num_full <= start:
            return
        for block, block_hash in zip(blocks[start:num_full], self._hashes(request, num_full)[start:]):
            if self.block_hash[block] is None and block_hash not in self.cached:
                self.cached[block_hash] = block
                self.block_hash[block] = block_hash
        self._num_registered[request.req_id] = num_full
