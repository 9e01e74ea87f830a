"""What `LLM.generate` returns, shaped like vLLM's `RequestOutput` / `CompletionOutput`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(frozen=True)
class CompletionOutput:
    """One of the `n` completions of a request.

    `finish_reason`: None while running, then "stop" (EOS, a stop token id or a stop string),
    "length" (max_tokens or max_model_len), "abort" or "error". `stop_reason` says which stop: the
    token id or the string (None for EOS).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestOutput:
    """`prompt` is None when the prompt was given as token ids. `num_cached_tokens` counts prompt
    tokens found in the prefix cache. `error` explains a request that failed on its own
    (finish_reason "error"), e.g. a prompt longer than max_model_len."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0
    error: str | None = None
