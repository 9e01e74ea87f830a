"""What the scheduler hands the runner each step, and what the runner hands back.

Host-side dataclasses with vLLM's field names (vllm/v1/core/sched/output.py, vllm/v1/outputs.py),
so a vLLM user recognises them. They carry plain Python values; the runner turns them into
padded device arrays. The scheduler's records check their own types when made (a count or an id
that is no integer would be truncated, or fail deep in the step): the runner then checks a
schedule only against what it holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NoReturn

import numpy as np

from jaxrunner.checks import all_ints, is_int
from jaxrunner.lora_request import LoRARequest
from jaxrunner.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner has not seen, or one coming back after preemption.

    `prefill_token_ids` is the prompt, plus the tokens already generated when a preempted
    request resumes (defaults to the prompt). `block_ids` holds one list per KV-cache group.
    `num_computed_tokens` counts tokens whose KV is already in the cache (prefix-cache hits).
    `lora_request`: the LoRA adapter it runs with (None: the base model).
    """

    req_id: str
    prompt_token_ids: list[int]
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int = 0
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    prefill_token_ids: list[int] | None = None
    lora_request: LoRARequest | None = None

    def __post_init__(self) -> None:
        rid = self.req_id
        if not isinstance(self.sampling_params, SamplingParams):
            reject(f"request {rid!r}: sampling_params must be a SamplingParams, got {type(self.sampling_params).__name__}")
        if self.lora_request is not None and not isinstance(self.lora_request, LoRARequest):
            reject(f"request {rid!r}: lora_request must be a LoRARequest, got {type(self.lora_request).__name__}")
        _ints(f"request {rid!r}: token ids", self.prompt_token_ids)
        if self.prefill_token_ids is not None:
            _ints(f"request {rid!r}: prefill token ids", self.prefill_token_ids)
        _block_ids(f"request {rid!r}: block_ids", self.block_ids)
        _ints("num_computed_tokens", [self.num_computed_tokens])

    @property
    def all_prefill_token_ids(self) -> list[int]:
        return self.prompt_token_ids if self.prefill_token_ids is None else self.prefill_token_ids


@dataclass(frozen=True)
class CachedRequestData:
    """Requests that ran before: blocks appended this step (None: no new blocks) and progress."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        _ints("num_computed_tokens", self.num_computed_tokens)
        for rid, groups in zip(self.req_ids, self.new_block_ids):
            if groups is not None:
                _block_ids(f"request {rid!r}: new_block_ids", groups)


@dataclass(frozen=True)
class KVTransfers:
    """The KV blocks that move between the device's cache and the host tier (`engine.host_tier`)
    with a step. `saves`: pieces, each a run of (device block, host slot) pairs that the host
    holds as one array and copies as one (its length one of the runner's copy buckets), copied to
    the host before the step writes anything (the blocks were just evicted from the device's prefix
    cache). `loads`: (host slot, device block) pairs, read from the host now and written into the
    cache before the first step after they arrived (`HostKV.arrived`), so that the copy overlaps
    the steps in between. `frees`: host slots whose blocks the tier let go of (after the loads read
    theirs): a piece's memory goes once none of its slots is held."""

    saves: tuple[tuple[tuple[int, int], ...], ...] = ()
    loads: tuple[tuple[int, int], ...] = ()
    frees: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.saves, (tuple, list)) or not all(
                isinstance(p, (tuple, list)) and p and all(isinstance(pair, (tuple, list)) for pair in p) for p in self.saves):
            reject(f"kv_transfers.saves must be pieces (non-empty runs of (block, slot) pairs), got {self.saves!r:.60}")
        for name, pairs in (("saves", [pair for piece in self.saves for pair in piece]), ("loads", self.loads)):
            if not isinstance(pairs, (tuple, list)) or not all(isinstance(p, (tuple, list)) and len(p) == 2 for p in pairs):
                reject(f"kv_transfers.{name} must be (block, slot) pairs, got {pairs!r:.60}")
            _ints(f"kv_transfers.{name}", [i for pair in pairs for i in pair])
        if not isinstance(self.frees, (tuple, list)):
            reject(f"kv_transfers.frees must be host slots, got {self.frees!r:.60}")
        _ints("kv_transfers.frees", self.frees)

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads or self.frees)


@dataclass(frozen=True)
class SchedulerOutput:
    """`num_steps` > 1 asks for multi-step decode: every scheduled request is a one-token decode, and
    each runs up to `num_steps` steps in one device call (`decode_steps` says how many; its blocks
    must hold them).

    Structured output: `grammar_bitmask` (int32 [rows, ceil(vocab_size / 32)], bit j of word i
    allowing token 32 i + j) holds the masks of the requests in `structured_output_request_ids`;
    request r's 1 + len(drafts) masks (for its next token, then after each draft) start at row
    structured_output_request_ids[r]. vLLM's layout. The engine's scheduler leaves `grammar_bitmask`
    None: it fills the masks while the forward pass runs and hands them to `Runner.sample_tokens`.

    `kv_transfers`: the blocks moving to and from the host tier with this step (`KVTransfers`).
    """

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    num_steps: int = 1
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    grammar_bitmask: np.ndarray | None = None
    kv_transfers: KVTransfers = field(default_factory=KVTransfers)

    def __post_init__(self) -> None:
        if not isinstance(self.kv_transfers, KVTransfers):
            reject(f"kv_transfers must be a KVTransfers, got {type(self.kv_transfers).__name__}")
        _ints("num_scheduled_tokens", list(self.num_scheduled_tokens.values()))
        _ints("total_num_scheduled_tokens and num_steps", [self.total_num_scheduled_tokens, self.num_steps])
        for rid, ids in self.scheduled_spec_decode_tokens.items():
            if not isinstance(ids, (list, tuple)) or not all_ints(ids):
                reject(f"request {rid!r}: draft tokens must be a list of integers, got {ids!r:.60}")


def _ints(what: str, values: Sequence) -> None:
    if not all_ints(values):
        reject(f"{what} must be integers, got {[v for v in values if not is_int(v)][:5]}")


def _block_ids(what: str, groups: object) -> None:
    if not isinstance(groups, (tuple, list)) or not all(isinstance(g, (tuple, list)) for g in groups):
        reject(f"{what} must hold one list of block ids per KV-cache group, got {groups!r:.60}")
    _ints(what, [b for group in groups for b in group])


def reject(problem: str) -> NoReturn:
    """A SchedulerOutput the runner cannot run: every check names its problem this way, before
    anything of the runner changes."""
    raise ValueError(f"SchedulerOutput rejected: {problem}")


def decode_steps(num_steps: int, num_tokens: int, num_outputs: int, params: SamplingParams, max_model_len: int) -> int:
    """How many of a multi-step call's `num_steps` a decode request runs (at least 1).

    It stops at its max_tokens and at the model length, and a call never crosses its min_tokens
    boundary, so the stop-token ban stays fixed within the call. Scheduler and runner both use it:
    the scheduler to allocate the blocks, the runner to run exactly those steps.
    """
    steps = min(num_steps, max_model_len - num_tokens)
    if params.max_tokens is not None:
        steps = min(steps, params.max_tokens - num_outputs)
    if num_outputs < params.min_tokens:
        steps = min(steps, params.min_tokens - num_outputs)
    return max(steps, 1)


@dataclass(frozen=True)
class LogprobsArrays:
    """Host copy of logprobs for n positions (vLLM's LogprobsTensors as numpy)."""

    token_ids: np.ndarray  # i32 [n, 1 + N]: the chosen token, then the top N
    logprobs: np.ndarray  # f32 [n, 1 + N]
    ranks: np.ndarray  # i32 [n]: rank of the chosen token

    @classmethod
    def concat(cls, parts: Sequence[LogprobsArrays]) -> LogprobsArrays:
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("token_ids", "logprobs", "ranks")))

    def select(self, rows: slice | np.ndarray, num_top: int) -> LogprobsArrays:
        """Some rows, with the chosen token and the first `num_top` top entries."""
        return LogprobsArrays(self.token_ids[rows, : 1 + num_top], self.logprobs[rows, : 1 + num_top], self.ranks[rows])


@dataclass(frozen=True)
class RunnerOutput:
    """One entry per scheduled request, in `req_ids` order.

    `sampled_token_ids[i]` is empty when request i only ran a non-final prefill chunk; after a
    multi-step call it holds every step's token, also past a stop token (the scheduler, which knows
    the stop conditions, cuts there).
    `logprobs[req_id]`: one row per sampled token (the token itself, then the request's top N),
    for requests that sampled and asked for logprobs. `prompt_logprobs_dict[req_id]`: one row per
    prompt position 1.., given once, in the step that completes the prompt.
    `num_nans_in_logits[req_id]`: NaN values in the logits its tokens were sampled from.
    `draft_token_ids[req_id]`: with speculative decoding, the drafts the device proposed for the
    request's next step (a structured request's scheduler checks them against its grammar).
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, LogprobsArrays] = field(default_factory=dict)
    prompt_logprobs_dict: dict[str, LogprobsArrays] = field(default_factory=dict)
    num_nans_in_logits: dict[str, int] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
