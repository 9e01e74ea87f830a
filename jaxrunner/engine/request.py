"""One generation request as the scheduler sees it: its tokens, progress and how it ended.

Mutable on purpose: the scheduler advances `num_computed_tokens` and appends sampled tokens every
step. Everything text-related (detokenization, stop strings) lives in the engine, not here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from jaxrunner.engine.structured_output import Grammar
from jaxrunner.lora_request import LoRARequest
from jaxrunner.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH_CAPPED = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")

    @property
    def finish_reason(self) -> str | None:
        """vLLM's `CompletionOutput.finish_reason`: "stop", "length", "abort", "error" or None."""
        return self.value if self.finished else None


@dataclass(eq=False)
class Request:
    """`max_tokens` is resolved (never None); `eos_token_ids` is empty when EOS must be ignored."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_prefill_tokens: int = 0  # tokens it was (re)admitted with: its decodes start after them
    # Prefix-cache hits at admission (vLLM's `num_cached_tokens`), from the first admission only.
    num_cached_tokens: int = -1
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Tokens being sampled by dispatched steps whose output has not come back (async scheduling).
    num_pending_tokens: int = 0
    num_nans_in_logits: int = 0
    error: str | None = None  # why a request that finished with an error did
    # Chained hashes of the full blocks of `all_token_ids`, filled lazily by the block manager.
    block_hashes: list[int] = field(default_factory=list)
    grammar: Grammar | None = None  # structured output: where the output is in its grammar
    draft_token_ids: list[int] = field(default_factory=list)  # a structured request's next drafts, from the runner
    lora_request: LoRARequest | None = None  # its LoRA adapter (None: the base model)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_expected_tokens(self) -> int:
        """Tokens known, plus those on their way."""
        return self.num_tokens + self.num_pending_tokens

    @property
    def reached_limit(self) -> bool:
        """Whether the tokens on their way already end the request at its max_tokens."""
        return self.num_output_tokens + self.num_pending_tokens >= self.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def stopped_on_token(self) -> bool:
        """Whether its last token, EOS or a stop token id, ended it (that token's text is not output;
        a grammar that completed ends a request on a token of the text)."""
        last = self.output_token_ids[-1] if self.output_token_ids else None
        return self.status == RequestStatus.FINISHED_STOPPED and (last in self.eos_token_ids or last == self.stop_reason)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """After a token is appended: the finished status it causes, if any (vLLM's order of checks).
        This is the one place that ends a request on a token: EOS (stop_reason None), a stop token id
        (stop_reason that id), a grammar that is complete, max_tokens or the model length. A
        structured request's grammar takes the token here; one it does not allow is an error."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.grammar is not None and not self.grammar.accept(last):
            self.error = f"output token {last} does not follow the request's grammar ({self.grammar.error})"
            return RequestStatus.FINISHED_ERROR
        if self.num_output_tokens >= params.min_tokens:
            if last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in (params.stop_token_ids or ()):
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if self.grammar is not None and self.grammar.stopped:
            return RequestStatus.FINISHED_STOPPED
        if self.num_tokens >= max_model_len or self.num_output_tokens >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None
