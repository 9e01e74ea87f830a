"""Prompts into checked token ids (vLLM's input processor): text tokenized, chats rendered through
the chat template, bad words tokenized, sampling parameters checked against the model.

A processor holds no engine state, so a server runs copies of it on worker threads and keeps long
prompts and slow templates off the engine's thread. Each copy has a tokenizer of its own: a
Hugging Face tokenizer used from two threads at once can fail.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from jaxrunner.checks import check_text, token_ids
from jaxrunner.engine.chat import Conversation, render_chat
from jaxrunner.sampling_params import SamplingParams

Prompt = str | list[int] | dict


@dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt tokenized and checked; `error` says why it cannot run (it then fails alone)."""

    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    error: str | None = None


@dataclass(frozen=True)
class Processor:
    """`check_params(params, prompt_len)` raises ValueError for what the runner rules out."""

    tokenizer: object | None
    check_params: Callable[[SamplingParams, int], None]
    max_model_len: int
    vocab_size: int

    def copy(self) -> Processor:
        """One with a tokenizer of its own, for another thread."""
        return dataclasses.replace(self, tokenizer=copy.deepcopy(self.tokenizer))

    def process(self, prompt: Prompt, params: SamplingParams) -> ProcessedPrompt:
        """Tokenize and check one prompt. Raises ValueError for a malformed prompt or for sampling
        parameters the engine or runner cannot honour; a prompt that is well-formed but cannot run
        (too long, token ids outside the vocabulary) carries its `error`."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        text, ids = self._tokenize(prompt)
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; use stop_token_ids with skip_tokenizer_init=True")
        if params.bad_words and self.tokenizer is not None:
            params = params.with_bad_words_tokenized(self.tokenizer)
        if params.structured_outputs is not None and self.tokenizer is None:
            raise ValueError("structured outputs need the tokenizer: leave skip_tokenizer_init off")
        self.check_params(params, len(ids))
        return ProcessedPrompt(text, ids, params, self._prompt_error(ids))

    def render_chat(self, messages: Conversation | Sequence[Conversation], chat_template: str | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False) -> list[dict]:
        return render_chat(self.tokenizer, messages, chat_template, add_generation_prompt, continue_final_message)

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), token_ids("prompt", "prompt_token_ids", prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; give token ids with skip_tokenizer_init=True")
            return prompt, list(self.tokenizer.encode(check_text("prompt", "the text", prompt)))
        if isinstance(prompt, (list, tuple, np.ndarray)):
            return None, token_ids("prompt", "a prompt of token ids", prompt)
        raise ValueError(
            f"unsupported prompt {prompt!r:.80}: give a string, a list of token ids or {{'prompt_token_ids': [...]}}"
        )

    def _prompt_error(self, ids: list[int]) -> str | None:
        max_len = self.max_model_len
        if not ids:
            return "the prompt is empty"
        if len(ids) > max_len:
            return (
                f"the prompt (length {len(ids)}) is longer than the maximum model length of {max_len}; "
                "shorten it or raise max_model_len"
            )
        if len(ids) == max_len:
            return (
                f"the prompt (length {len(ids)}) fills the maximum model length of {max_len}, leaving no room "
                "for output; shorten it or raise max_model_len"
            )
        if bad := [t for t in ids if not 0 <= t < self.vocab_size]:
            return f"the prompt holds token ids {bad[:5]} outside the model's vocabulary (size {self.vocab_size})"
        return None
