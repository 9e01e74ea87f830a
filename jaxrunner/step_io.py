"""What the scheduler hands the runner each step, and what the runner hands back.

Host-side dataclasses with vLLM's field names (vllm/v1/core/sched/output.py, vllm/v1/outputs.py),
so a vLLM user recognises them. They carry plain Python values; the runner turns them into
padded device arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxrunner.sampling.logprobs import LogprobsArrays
from jaxrunner.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner has not seen, or one coming back after preemption.

    `prefill_token_ids` is the prompt, plus the tokens already generated when a preempted
    request resumes (defaults to the prompt). `block_ids` holds one list per KV-cache group.
    `num_computed_tokens` counts tokens whose KV is already in the cache (prefix-cache hits).
    """

    req_id: str
    prompt_token_ids: list[int]
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int = 0
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    prefill_token_ids: list[int] | None = None
    lora_name: str | None = None

    @property
    def all_prefill_token_ids(self) -> list[int]:
        return self.prompt_token_ids if self.prefill_token_ids is None else self.prefill_token_ids


@dataclass(frozen=True)
class CachedRequestData:
    """Requests that ran before: blocks appended this step (None: no new blocks) and progress."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class RunnerOutput:
    """One entry per scheduled request, in `req_ids` order.

    `sampled_token_ids[i]` is empty when request i only ran a non-final prefill chunk.
    `logprobs[req_id]`: one row for the sampled token (the token itself, then the request's top N),
    for requests that sampled and asked for logprobs. `prompt_logprobs_dict[req_id]`: one row per
    prompt position 1.., given once, in the step that completes the prompt.
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, LogprobsArrays] = field(default_factory=dict)
    prompt_logprobs_dict: dict[str, LogprobsArrays] = field(default_factory=dict)
    num_nans_in_logits: dict[str, int] = field(default_factory=dict)
