"""A fake runner for scheduler tests, and the block manager's invariants.

`FakeRunner` keeps `Runner.step`'s contract (slots freed by finished/preempted ids, new requests
carry all their blocks, a token is sampled only when the known tokens are all computed) with a toy
model whose "KV cache" stores token ids. Each step writes the scheduled tokens into their slots and
reads every scheduled request's context back through its block table, so a block handed to the
wrong request, shared when it should not be or evicted while in use shows up as a wrong context.
With several KV-cache groups (`windows`, one per group) every group's blocks get the tokens, and a
sliding group's are read back over its window only. With `host_blocks`, it keeps a host tier's pool
and copies blocks in `runner.host_kv`'s order: the loads that arrived written first, this step's
loads read, the freed slots dropped, then this step's saves taken; a step's loads arrive
`load_delay` steps later than they could. A copy in the wrong order, to the wrong block or read
too soon shows up as a wrong context too, a load from a freed slot fails, and so do a pool whose
pieces (each held while one of its slots is) hold more than `host_blocks` rows, and loads whose
pieces on their way hold more than `max_loads` rows.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

from jaxrunner.engine.block_manager import BlockManager
from jaxrunner.engine.scheduler import Scheduler
from jaxrunner.sampling_params import SamplingParams
from jaxrunner.step_io import KVTransfers, RunnerOutput, SchedulerOutput, decode_steps

VOCAB = 50


def next_token(tokens: list[int]) -> int:
    """The toy model: a deterministic function of the whole context."""
    h = 0
    for t in tokens:
        h = (h * 31 + t + 1) % 1_000_003
    return h % VOCAB


def reference_output(prompt: list[int], max_tokens: int, max_model_len: int, eos: int | None) -> list[int]:
    """What one request alone must produce: the toy model's greedy tokens until a stop condition."""
    tokens = list(prompt)
    out: list[int] = []
    while True:
        out.append(next_token(tokens))
        tokens.append(out[-1])
        if out[-1] == eos or len(out) >= max_tokens or len(tokens) >= max_model_len:
            return out


@dataclass
class _Row:
    tokens: list[int]
    blocks: list[list[int]]  # per KV-cache group
    computed: int
    prompt_len: int
    params: SamplingParams


class FakeRunner:
    def __init__(
        self, num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int = 64,
        windows: tuple[int | None, ...] = (None,), host_blocks: int = 0, load_delay: int = 0,
    ) -> None:
        self.windows = windows
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.cache: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.rows: dict[str, _Row] = {}
        self.host: list[list[int | None] | None] = [None] * host_blocks
        self.load_delay = load_delay
        self.steps = 0
        self.max_loads = host_blocks
        self._pieces: dict[int, int] = {}  # host slot -> its piece's number, while held
        self._rows: list[int] = []  # rows per piece
        # (arrival step, rows moved, pages)
        self._arriving: deque[tuple[int, int, list[tuple[int, list[int | None]]]]] = deque()
        self._written = 0
        self.num_loaded = 0

    def arrived(self) -> int:
        """`HostKV.arrived`: the load batches written, then those arrived by now."""
        return self._written + sum(1 for _ in itertools.takewhile(lambda b: b[0] <= self.steps, self._arriving))

    def _transfer(self, transfers: KVTransfers) -> None:
        for _ in range(self.arrived() - self._written):
            for block, page in self._arriving.popleft()[2]:
                self.cache[block] = page
            self._written += 1
        if transfers.loads:
            assert all(self.host[slot] is not None for slot, _ in transfers.loads), "a load from a freed slot"
            rows = sum(self._rows[p] for p in {self._pieces[slot] for slot, _ in transfers.loads})
            self._arriving.append((self.steps + 1 + self.load_delay, rows,
                                   [(block, list(self.host[slot])) for slot, block in transfers.loads]))
            assert sum(entry[1] for entry in self._arriving) <= self.max_loads, "loads on their way past the bound"
        for slot in transfers.frees:
            self.host[slot] = None
            del self._pieces[slot]
        for piece in transfers.saves:
            for block, slot in piece:
                self.host[slot] = list(self.cache[block])
                self._pieces[slot] = len(self._rows)
            self._rows.append(len(piece))
        held = sum(self._rows[p] for p in set(self._pieces.values()))
        assert held <= len(self.host), f"the pool's pieces hold {held} rows, more than its {len(self.host)} slots"
        self.num_loaded += len(transfers.loads)

    def step(self, sched: SchedulerOutput) -> RunnerOutput:
        bs = self.block_size
        self._transfer(sched.kv_transfers)
        self.steps += 1
        for rid in sched.finished_req_ids | sched.preempted_req_ids:
            self.rows.pop(rid, None)
        for new in sched.scheduled_new_reqs:
            assert new.req_id not in self.rows
            assert new.num_computed_tokens % bs == 0
            self.rows[new.req_id] = _Row(
                list(new.all_prefill_token_ids), [list(g) for g in new.block_ids], new.num_computed_tokens,
                len(new.prompt_token_ids), new.sampling_params,
            )
        cached = sched.scheduled_cached_reqs
        for rid, blocks, computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            row = self.rows[rid]
            assert row.computed == computed, f"{rid}: scheduler says {computed} computed, runner has {row.computed}"
            assert blocks is None or len(blocks) == len(self.windows) and any(blocks)
            for held, more in zip(row.blocks, blocks or ()):
                held += more
        assert len(self.rows) <= self.max_num_seqs
        assert sched.total_num_scheduled_tokens == sum(sched.num_scheduled_tokens.values())
        assert sched.total_num_scheduled_tokens <= self.max_num_batched_tokens
        assert set(sched.num_scheduled_tokens) == {n.req_id for n in sched.scheduled_new_reqs} | set(cached.req_ids)

        req_ids = list(sched.num_scheduled_tokens)
        sampled = [self._run(self.rows[rid], sched.num_scheduled_tokens[rid], sched.num_steps) for rid in req_ids]
        return RunnerOutput(req_ids, {rid: i for i, rid in enumerate(req_ids)}, sampled)

    def _run(self, row: _Row, n: int, num_steps: int) -> list[int]:
        """Compute n tokens (or, multi-step, decode steps), cut at a stop token id; the tokens sampled."""
        bs = self.block_size
        steps = 1
        if num_steps > 1:
            assert n == 1 and row.computed + 1 == len(row.tokens), "multi-step with a non-decode"
            steps = decode_steps(num_steps, len(row.tokens), len(row.tokens) - row.prompt_len, row.params, self.max_model_len)
        assert all(len(held) * bs >= row.computed + max(n, steps) for held in row.blocks), \
            "blocks do not cover the scheduled tokens"
        out = []
        for _ in range(steps):
            assert n >= 1 and row.computed + n <= len(row.tokens)
            for held in row.blocks:
                for pos in range(row.computed, row.computed + n):
                    self.cache[held[pos // bs]][pos % bs] = row.tokens[pos]
            row.computed += n
            for held, window in zip(row.blocks, self.windows):
                first = 0 if window is None else max(0, row.computed - window)
                context = [self.cache[held[p // bs]][p % bs] for p in range(first, row.computed)]
                assert context == row.tokens[first : row.computed], "the KV cache holds another request's tokens"
            context = row.tokens[: row.computed]
            if row.computed < len(row.tokens):
                return out
            row.tokens.append(next_token(context))
            out.append(row.tokens[-1])
            if out[-1] in (row.params.stop_token_ids or ()):
                break
        return out


def check_block_invariants(bm: BlockManager) -> None:
    """Reference counts equal owners; the free queue is exactly the unowned blocks; a block held by
    several requests is a cached full block; the hash map and the blocks' hashes agree."""
    owners = [0] * bm.num_blocks
    for groups in [*bm.req_blocks.values(), *bm.parked.values()]:
        assert len(groups) == len(bm.windows) and len({len(held) for held in groups}) == 1
        blocks = [b for held in groups for b in held if b >= bm.num_reserved]  # the null block is no one's
        assert len(set(blocks)) == len(blocks), "a request holds a block twice"
        for b in blocks:
            owners[b] += 1
    assert owners[bm.num_reserved :] == bm.ref_counts[bm.num_reserved :]
    assert set(bm.free_queue) == {b for b in range(bm.num_reserved, bm.num_blocks) if bm.ref_counts[b] == 0}
    assert all(bm.block_hash[b] is not None for b in range(bm.num_blocks) if bm.ref_counts[b] > 1)
    assert {b: h for h, b in bm.cached.items()} == {b: h for b, h in enumerate(bm.block_hash) if h is not None}
    if bm.host_tier is not None:
        slots = list(bm.host_tier.slots.values())
        assert len(set(slots)) == len(slots) <= bm.host_tier.num_slots and all(0 <= s < bm.host_tier.num_slots for s in slots)


def check_scheduler_invariants(scheduler: Scheduler) -> None:
    bm, cfg = scheduler.block_manager, scheduler.config
    check_block_invariants(bm)
    assert len(scheduler.running) <= cfg.max_num_seqs
    for request in scheduler.running:
        assert all(len(held) * bm.block_size >= request.num_computed_tokens for held in bm.block_ids(request.req_id))
    assert all(not any(bm.block_ids(r.req_id)) for r in scheduler.waiting), "a waiting request holds blocks"
    assert len(scheduler.running) + len(scheduler.loading) <= cfg.max_num_seqs
    assert all(any(bm.block_ids(rid)) for rid in scheduler.loading), "a loading request holds no blocks"
