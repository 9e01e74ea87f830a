"""What `LLM.generate` returns, shaped like vLLM's `RequestOutput` / `CompletionOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    """`rank`: 1 for the likeliest token. `decoded_token`: the token decoded alone (None without a
    tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(frozen=True)
class CompletionOutput:
    """One of the `n` completions of a request.

    `finish_reason`: None while running, then "stop" (EOS, a stop token id or a stop string),
    "length" (max_tokens or max_model_len), "abort" or "error". `stop_reason` says which stop: the
    token id or the string (None for EOS). `logprobs` (None unless the request asked for them): one
    {token_id: Logprob} dict per entry of `token_ids`, holding that token and the top N;
    `cumulative_logprob` sums the logprobs of every token generated so far (delta outputs too).
    `num_nans_in_logits`: NaN values in the logits the completion was sampled from (any ends it with
    finish_reason "error").
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_nans_in_logits: int = 0

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestOutput:
    """`prompt` is None when the prompt was given as token ids. `num_cached_tokens` counts prompt
    tokens found in the prefix cache. `error` explains a request that failed on its own
    (finish_reason "error"), e.g. a prompt longer than max_model_len. `prompt_logprobs` (None unless
    asked for): None for the first prompt token, then one dict per prompt token, like `logprobs`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    error: str | None = None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's counters (`LLMEngine.stats()`); the counts are since start-up."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks held by requests
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int
    num_preemptions: int
    num_nans_in_logits: int
    # The prefix cache's host tier (`engine.host_tier`; zeros without one): prompt tokens found
    # there (among prefix_cache_hits), bytes copied each way, host time the copies took.
    kv_offload_hits: int = 0
    kv_offload_bytes_saved: int = 0
    kv_offload_bytes_loaded: int = 0
    kv_offload_seconds: float = 0.0
    # Speculative decoding (empty when off): drafts, accepted drafts, acceptance rate overall and
    # per draft position, mean tokens per decode with drafts (`scheduler.SpecDecodingStats`).
    spec_decoding: dict = field(default_factory=dict)
