"""The scheduler: which requests run each step, how many tokens each, in the style of vLLM v1.

Each step has a token budget (`max_num_batched_tokens`). Running requests go first, in arrival
order: a decode costs one token, an unfinished prefill takes what is left of the budget (chunked
prefill). When a running request needs a block and none is free, the most recently admitted running
request is preempted: its blocks are freed and it goes back to the front of the queue, to be
recomputed later from its prompt plus the tokens it already produced (the prefix cache usually
finds most of them). Waiting requests are admitted first come, first served while the budget,
`max_num_seqs` and the free blocks allow, but not in a step that had to preempt.

Steps may be scheduled before the previous step's tokens are back (async scheduling): a request
counts its tokens on their way (`num_pending_tokens`) as known, and is not scheduled past its
max_tokens or the model length. A request that stops on a token that comes back later has run one
step for nothing; that step's token is dropped. When every scheduled request is a decode,
`num_scheduler_steps` > 1 asks the runner for that many decode steps in one call (with the blocks
they need), and the request takes up to that many tokens, cut at its stop.

With speculative decoding (`num_speculative_tokens` = k) a decode schedules 1 + n tokens, n <= k
drafts (fewer near max_tokens or the model length, or within the budget), and blocks for all of
them (and a draft model's k proposals past them). The drafts are the device's (-1 placeholders) unless a host `proposer` gives them. The
scheduler counts every draft as accepted while the step is in flight (its blocks and lengths are
then upper bounds), and takes the rejected ones back off `num_computed_tokens` when the output
comes: async scheduling needs no wait. `spec_stats` counts drafts and acceptances.

A structured request (one with a `grammar`) samples under a mask per token (`grammar_bitmask`:
its next token, then one after each draft), which needs the grammar past every token before.
The step names its rows (`structured_output_request_ids`); `grammar_bitmask(sched)` fills them
once the steps before are taken, while the device runs this step's forward pass (vLLM's order).
With speculative decoding its drafts are the ones the device proposed last
(`RunnerOutput.draft_token_ids`), cut where the grammar stops allowing them, so such a request
waits for its step in flight. Structured requests never run in a multi-step call.

A request with a LoRA adapter is admitted only while the running requests use at most `max_loras`
adapters with it (the runner's device slots); the others wait in their place in the queue.

With a host tier, a waiting request whose prefix hit continues in host memory is a cheap prefill:
it takes its blocks (the host ones among them copied in from this step on, `SchedulerOutput.
kv_transfers`) and waits in `loading` until they have arrived (`HostTier.arrived`), so the copy
overlaps the steps and none waits on it; then it is admitted before the waiting requests. One that
ends meanwhile keeps its blocks until they have arrived: given to another request sooner, they
would be overwritten under it. The blocks loading at once are bounded (`HostTier.room`, the device
memory KV sizing sets aside for them, counted in the pieces that move): a hit that needs more than
is free waits for the loads on their way, and one longer than the bound loads in parts, each once
the part before has arrived, computing only what neither cache holds by then.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from jaxrunner.engine.block_manager import BlockManager, HostBlock, num_loads
from jaxrunner.engine.request import Request, RequestStatus
from jaxrunner.engine.structured_output import fill_bitmask
from jaxrunner.step_io import CachedRequestData, NewRequestData, RunnerOutput, SchedulerOutput, decode_steps


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    num_scheduler_steps: int = 1
    num_speculative_tokens: int = 0
    num_lookahead_tokens: int = 0  # KV slots a step writes past its tokens (a draft model's proposals)
    vocab_size: int = 0  # the width of structured requests' masks
    max_loras: int = 0  # LoRA adapters the running requests may use at once (0: LoRA off)


# Draft tokens for a request, given how many the step can take (vLLM's host-side proposers).
Proposer = Callable[[Request, int], list[int]]


@dataclass
class SpecDecodingStats:
    """vLLM's speculative-decoding counters, over the decodes that carried drafts."""

    num_drafts: int = 0  # decodes with at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)  # [i]: decodes with a draft i
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: decodes whose draft i was accepted

    def add(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for counts in (self.drafted_per_position, self.accepted_per_position):
            counts += [0] * (num_drafted - len(counts))
        for i in range(num_drafted):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += i < num_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per decode with drafts: 1 + the accepted drafts."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens, "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_rate_per_position": [a / d for a, d in zip(self.accepted_per_position, self.drafted_per_position)],
        }


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, proposer: Proposer | None = None) -> None:
        self.config = config
        self.block_manager = block_manager
        self.proposer = proposer  # None: the device proposes (placeholders)
        self.spec_stats = SpecDecodingStats()
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # By id: the requests holding their blocks while the host tier's arrive, the tokens their
        # blocks were taken for (admitted with as many or fewer, they need no more blocks; 0 where
        # the bound on loads cut the hit, which continues once they have arrived), and the load batch
        # that brings them; and those of them that ended meanwhile, with their batch.
        self.loading: dict[str, tuple[Request, int, int]] = {}
        self._ended_loading: list[tuple[int, int]] = []  # (`BlockManager.park` token, batch)
        self.num_preemptions = 0
        # Requests that left while the runner held them; reported (and forgotten) by the next step.
        self._finished_in_runner: set[str] = set()
        self.num_nans_in_logits = 0  # NaN logits the runner reported, over every request
        # Per scheduled step, oldest first, until its output is back: each scheduled request (the
        # object: an id can be re-used once its request ended), its preemption count when scheduled
        # (a token from before a preemption is dropped), the most tokens it samples and its drafts.
        self._in_flight: deque[dict[str, tuple[Request, int, int, int]]] = deque()

    def add_request(self, request: Request) -> None:
        if request.req_id in self.requests:
            raise ValueError(f"request id {request.req_id!r} is already in use")
        if not 0 < request.num_tokens < self.config.max_model_len:
            raise ValueError(
                f"request {request.req_id!r} has {request.num_tokens} tokens; it needs between 1 and "
                f"max_model_len - 1 = {self.config.max_model_len - 1} to leave room for output"
            )
        self.requests[request.req_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        """Also while the blocks of a request that ended loading are on their way (steps land them)."""
        return bool(self.waiting or self.running or self.loading or self._ended_loading)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_blocks: dict[str, tuple[list[int], ...]] = {}  # per KV-cache group
        preempted: list[Request] = []
        drafts: dict[str, list[int]] = {}
        waited = False  # a running or loaded request waits for blocks (or room to load): no admission either
        arrived = self._loads_arrived()

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.reached_limit or request.num_expected_tokens >= self.config.max_model_len:
                i += 1  # the tokens on their way finish it
                continue
            if request.grammar is not None and request.num_pending_tokens and self.config.num_speculative_tokens:
                i += 1  # its drafts come with the output on its way
                continue
            n = min(request.num_expected_tokens - request.num_computed_tokens, budget)
            draft_ids = self._drafts(request, self._num_drafts(request, budget))
            n += len(draft_ids)
            extra = self._lookahead(request.num_computed_tokens + n)
            fresh = self.block_manager.allocate_slots(request, n + extra)
            if fresh is None and (self.loading or self._ended_loading):
                if self.loading:  # the newest gives its blocks back, once its loads have landed
                    self._preempt(next(reversed(self.loading.values()))[0])
                waited = True  # rather than preempt running requests, wait for those blocks
                i += 1
                continue
            while fresh is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
                fresh = self.block_manager.allocate_slots(request, n + extra)
            if fresh is None:
                break
            if draft_ids:
                drafts[request.req_id] = draft_ids
            num_scheduled[request.req_id] = n
            new_blocks[request.req_id] = fresh
            budget -= n
            i += 1

        admitted: list[Request] = []
        budget, held = self._admit_loaded(arrived, budget, admitted, num_scheduled)
        waited = waited or held
        skipped: list[Request] = []  # their adapter would exceed max_loras: they keep their place in the queue
        while (self.waiting and budget > 0 and not preempted and not waited
               and len(self.running) + len(self.loading) < self.config.max_num_seqs):
            request = self.waiting[0]
            if not self._adapter_fits(request):
                skipped.append(self.waiting.popleft())
                continue
            if (hit := self._hit(request)) is None:
                break  # other loads hold the device memory its loads need: it waits for them
            hits, num_hit_tokens, cut = hit
            n = 0 if cut else min(request.num_tokens - num_hit_tokens, budget)
            lookahead = 0 if cut else self._lookahead(num_hit_tokens + n)  # a cut hit's next part comes first
            if self.block_manager.allocate_slots(request, n + lookahead, hits) is None:
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            if num_loads(hits):  # the batch this step's loads make
                self.loading[request.req_id] = (request, n, self.block_manager.host_tier.batches + 1)
                continue
            self._admit(request, admitted, num_scheduled, n)
            budget -= n
        self.waiting.extendleft(reversed(skipped))

        steps = self._decode_steps(num_scheduled, new_blocks) if not (admitted or preempted) else None
        structured = [r for r in map(self.requests.get, num_scheduled) if r.grammar is not None
                      and r.num_computed_tokens + num_scheduled[r.req_id] >= r.num_expected_tokens]  # those that sample
        out = self._build_output(admitted, num_scheduled, new_blocks, preempted, steps, drafts, structured)
        if self.block_manager.host_tier is not None:
            out = dataclasses.replace(out, kv_transfers=self.block_manager.host_tier.take())
        scheduled = {}
        for req_id, n in num_scheduled.items():
            request = self.requests[req_id]
            num_drafts = len(drafts.get(req_id, ()))
            if steps:  # one decode token, then a token per extra step
                request.num_computed_tokens += steps[req_id]
                num_sampled = steps[req_id]
            else:  # a decode with drafts samples up to 1 + num_drafts: counted as if all were accepted
                request.num_computed_tokens += n
                num_sampled = num_drafts + int(request.num_computed_tokens - num_drafts == request.num_expected_tokens)
            request.num_pending_tokens += num_sampled
            scheduled[req_id] = (request, request.num_preemptions, num_sampled, num_drafts)
        self._in_flight.append(scheduled)
        return out

    def _load_room(self) -> int | None:
        """The rows this step may still load from the host tier (None: no host tier)."""
        return self.block_manager.host_tier.room() if self.block_manager.host_tier is not None else None

    def _loads_arrived(self) -> int:
        """The host tier's load batches that have arrived; the parked blocks they were for go back."""
        arrived = self.block_manager.host_tier.arrived() if self.block_manager.host_tier is not None else 0
        for token, batch in [e for e in self._ended_loading if e[1] <= arrived]:
            self._ended_loading.remove((token, batch))
            self.block_manager.unpark(token)
        return arrived

    def _admit_loaded(self, arrived: int, budget: int, admitted: list[Request],
                      num_scheduled: dict[str, int]) -> tuple[int, bool]:
        """Admit the loading requests whose blocks have arrived, in order, within the budget (they
        hold their blocks); the budget left, and whether one of them waits for blocks or for the
        room to load the next part of its hit (then no waiting request is admitted before it)."""
        for request, allocated, batch in list(self.loading.values()):
            if batch > arrived:
                break
            if not allocated:  # the bound on loads cut its hit
                if (more := self._continue_hit(request)) is not False:
                    return budget, more is None
                allocated = request.num_tokens - request.num_computed_tokens
            n = min(allocated, budget)
            if not n:
                break
            if self.block_manager.allocate_slots(request, n + self._lookahead(request.num_computed_tokens + n)) is None:
                newest = next(reversed(self.loading.values()))[0]
                if not self.running and newest is not request:  # a cut hit takes its blocks now: make room
                    self._preempt(newest)
                return budget, True
            del self.loading[request.req_id]
            self._admit(request, admitted, num_scheduled, n)
            budget -= n
        return budget, False

    def _hit(self, request: Request, start: int = 0) -> tuple[tuple[list[int | HostBlock], ...], int, bool] | None:
        """The request's prefix-cache hit past the first `start` blocks (`get_computed_blocks`), and
        whether the bound on loads cut it; None while other loads hold the room it needs."""
        bm = self.block_manager
        hits, num_hit_tokens = bm.get_computed_blocks(request, start=start)
        if (room := self._load_room()) is None or bm.load_rows(hits) <= room:
            return hits, num_hit_tokens, False
        if room < bm.host_tier.max_loads:
            return None
        hits, num_hit_tokens = bm.get_computed_blocks(request, max_loads=room, start=start)
        return hits, num_hit_tokens, num_loads(hits) > 0

    def _continue_hit(self, request: Request) -> bool | None:
        """Take the next part of a loading request's hit that the bound on loads cut, now that the
        part before has arrived: True while it loads, None while it waits for the room to, False
        once the caches hold no more of it or the blocks for it are not free (the rest is computed)."""
        if (hit := self._hit(request, request.num_computed_tokens // self.block_manager.block_size)) is None:
            return None
        hits, num_hit_tokens, _ = hit
        if num_hit_tokens == request.num_computed_tokens or self.block_manager.allocate_slots(request, 0, hits) is None:
            return False
        if not request.num_preemptions:  # its first admission's hit, continued
            request.num_cached_tokens = num_hit_tokens
        request.num_computed_tokens = num_hit_tokens
        if not num_loads(hits):
            return False
        self.loading[request.req_id] = (request, 0, self.block_manager.host_tier.batches + 1)
        return True

    def _admit(self, request: Request, admitted: list[Request], num_scheduled: dict[str, int], n: int) -> None:
        """Start running a request that holds its blocks, with `n` tokens this step."""
        request.status = RequestStatus.RUNNING
        request.num_prefill_tokens = request.num_tokens
        self.running.append(request)
        admitted.append(request)
        num_scheduled[request.req_id] = n

    def _adapter_fits(self, request: Request) -> bool:
        """Whether the running requests' adapters, with this request's, stay within max_loras."""
        if request.lora_request is None:
            return True
        holding = self.running + [entry[0] for entry in self.loading.values()]
        running = {r.lora_request.lora_int_id for r in holding if r.lora_request is not None}
        return request.lora_request.lora_int_id in running or len(running) < self.config.max_loras

    def _drafts(self, request: Request, num_drafts: int) -> list[int]:
        """A decode's drafts: the host proposer's, a structured request's from the device's last
        proposal, else placeholders for the device's; a grammar keeps those it allows."""
        if not num_drafts:
            return []
        if self.proposer is not None:
            drafts = self.proposer(request, num_drafts)[:num_drafts]
        elif request.grammar is not None:
            drafts = request.draft_token_ids[:num_drafts]
        else:
            return [-1] * num_drafts
        return request.grammar.valid_drafts(drafts) if request.grammar is not None else drafts

    def _lookahead(self, reach: int) -> int:
        """Slots past a step's tokens that the step writes too: a draft model's k steps ahead."""
        return max(0, min(self.config.num_lookahead_tokens, self.config.max_model_len - reach))

    def _num_drafts(self, request: Request, budget: int) -> int:
        """Drafts for a decode: up to k, none past max_tokens or the model length or the budget, and
        none before the runner has sampled for the request (since its admission)."""
        k = self.config.num_speculative_tokens
        decoding = request.num_computed_tokens >= request.num_prefill_tokens
        if not k or not decoding or request.num_expected_tokens - request.num_computed_tokens != 1:
            return 0
        room = min(request.max_tokens - request.num_output_tokens - request.num_pending_tokens,
                   self.config.max_model_len - request.num_expected_tokens, budget) - 1
        return max(0, min(k, room))

    def _decode_steps(self, num_scheduled: dict[str, int],
                      new_blocks: dict[str, tuple[list[int], ...]]) -> dict[str, int] | None:
        """Multi-step decode: the steps of each request when all of them are one-token decodes and
        their blocks for the extra steps can be had (None otherwise: one step)."""
        k = self.config.num_scheduler_steps
        requests = [self.requests[rid] for rid in num_scheduled]
        if k == 1 or not requests or any(r.num_computed_tokens + 1 != r.num_expected_tokens or r.grammar is not None
                                         for r in requests):
            return None
        steps = {
            r.req_id: decode_steps(k, r.num_expected_tokens, r.num_output_tokens + r.num_pending_tokens,
                                   r.sampling_params, self.config.max_model_len)
            for r in requests
        }
        if max(steps.values()) == 1:
            return None
        for r in requests:
            fresh = self.block_manager.allocate_slots(r, steps[r.req_id])
            if fresh is None:
                return None
            for group, more in zip(new_blocks[r.req_id], fresh):
                group += more
        return steps

    def _build_output(
        self,
        admitted: list[Request],
        num_scheduled: dict[str, int],
        new_blocks: dict[str, tuple[list[int], ...]],
        preempted: list[Request],
        steps: dict[str, int] | None,
        drafts: dict[str, list[int]],
        structured: list[Request],
    ) -> SchedulerOutput:
        new_reqs = [
            NewRequestData(
                req_id=r.req_id,
                prompt_token_ids=r.prompt_token_ids,
                block_ids=self.block_manager.block_ids(r.req_id),
                num_computed_tokens=r.num_computed_tokens,
                sampling_params=r.sampling_params,
                prefill_token_ids=r.all_token_ids if r.output_token_ids else None,
                lora_request=r.lora_request,
            )
            for r in admitted
        ]
        admitted_ids = {r.req_id for r in admitted}
        cached_ids = [rid for rid in num_scheduled if rid not in admitted_ids]
        cached = CachedRequestData(
            req_ids=cached_ids,
            new_block_ids=[new_blocks[rid] if any(new_blocks[rid]) else None for rid in cached_ids],
            num_computed_tokens=[self.requests[rid].num_computed_tokens for rid in cached_ids],
        )
        finished, self._finished_in_runner = self._finished_in_runner, set()
        rows, row = {}, 0
        for r in structured:
            rows[r.req_id] = row
            row += 1 + len(drafts.get(r.req_id, ()))
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            scheduled_spec_decode_tokens=drafts,
            finished_req_ids=finished,
            preempted_req_ids={r.req_id for r in preempted},
            num_steps=self.config.num_scheduler_steps if steps else 1,
            structured_output_request_ids=rows,
        )

    def grammar_bitmask(self, sched: SchedulerOutput) -> np.ndarray | None:
        """`sched`'s grammar masks, from its structured requests' grammars as they are now (past the
        tokens of every step before it). A request that ended since it was scheduled gets masks
        allowing everything: its token is dropped."""
        starts = sched.structured_output_request_ids
        if not starts:
            return None
        requests = [self.requests.get(rid) for rid in starts]  # in row order: the scheduler numbered them so
        masks = [(None if r is None else r.grammar, sched.scheduled_spec_decode_tokens.get(rid, []))
                 for rid, r in zip(starts, requests)]
        return fill_bitmask(masks, self.config.vocab_size)

    def _preempt(self, request: Request) -> None:
        """Back to the front of the queue, to be computed again."""
        self._release(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_pending_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_from_output(self, out: RunnerOutput) -> dict[str, list[int]]:
        """Take the output of the oldest step in flight: append the sampled tokens and finish requests
        that hit a stop condition. Returns the new tokens (cut at the token that finished the request)
        of every request that gained tokens or finished. Tokens of requests that ended or were
        preempted since the step was scheduled are dropped. A request whose logits held NaN keeps none
        of the step's tokens and finishes with an error (`Request.error` says so)."""
        progressed: dict[str, list[int]] = {}
        for req_id, (request, preemptions, expected, num_drafts) in self._in_flight.popleft().items():
            if self.requests.get(req_id) is not request or request.num_preemptions != preemptions:
                continue
            request.num_pending_tokens -= expected
            sampled = out.sampled_token_ids[out.req_id_to_index[req_id]]
            if not expected - num_drafts <= len(sampled) <= expected:
                raise RuntimeError(f"runner returned {len(sampled)} tokens for request {req_id!r}, expected "
                                   f"{expected - num_drafts}{f' to {expected}' if num_drafts else ''}")
            if num_drafts:  # the rejected drafts' KV does not count; the next steps overwrite it
                request.num_computed_tokens -= expected - len(sampled)
                self.spec_stats.add(num_drafts, len(sampled) - 1)
            if request.grammar is not None:
                request.draft_token_ids = out.draft_token_ids.get(req_id, [])
            if nans := out.num_nans_in_logits.get(req_id, 0):
                self.num_nans_in_logits += nans
                request.num_nans_in_logits += nans
                request.error = (f"the model's logits held {nans} NaN values at output token {request.num_output_tokens}; "
                                 "generation stopped there (check the weights and the dtype)")
                self._finish(request, RequestStatus.FINISHED_ERROR)
                progressed[req_id] = []
                continue
            kept = []
            for token in sampled:
                request.output_token_ids.append(token)
                kept.append(token)
                status = request.check_stop(self.config.max_model_len)
                if status is not None:
                    self._finish(request, status)
                    break
            if len(kept) < len(sampled) and not request.is_finished:
                raise RuntimeError(f"request {req_id!r} kept {len(kept)} of {len(sampled)} tokens without a stop")
            if kept:
                progressed[req_id] = kept
        return progressed

    def finish_requests(self, req_ids: list[str], status: RequestStatus) -> None:
        """End requests from outside the step (a stop string matched, an abort)."""
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is not None and not request.is_finished:
                self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self._finished_in_runner.add(request.req_id)
        elif request.req_id not in self.loading:
            self.waiting.remove(request)
        self._release(request)
        request.status = status
        del self.requests[request.req_id]

    def _release(self, request: Request) -> None:
        """Give the request's blocks back; a loading request's once its loads have landed (sooner,
        another request would have them overwritten under it)."""
        if (loading := self.loading.pop(request.req_id, None)) is not None:
            self._ended_loading.append((self.block_manager.park(request), loading[2]))
        else:
            self.block_manager.free(request)
