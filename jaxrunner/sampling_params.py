"""Per-request sampling parameters, with vLLM's names and meanings, checked on construction.

Checks that need the model (vocabulary size, the engine's logprobs limit) live in `verify`, which
the engine calls once when a request arrives (`jaxrunner.sampling.prepare_request` calls it).
Bad words are strings; the sampler needs their token ids: `with_bad_words_tokenized(tokenizer)`
fills `bad_words_token_ids` the way vLLM does (each word with and without a leading space).
`structured_outputs` constrains the output to a grammar (`StructuredOutputsParams`, vLLM's).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Protocol

from jaxrunner.checks import check_bool, check_int, check_real, check_text, token_ids

# Below this temperature sampling is greedy, as in vLLM.
GREEDY_TEMPERATURE = 1e-5


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's structured-output request: exactly one of a JSON schema (a dict or its text), a regex
    the whole output matches, a list of choices, a Lark grammar, or any JSON object.

    Between two tokens of the JSON syntax, JSON holds at most a line break and some indentation,
    which spares a small model from wandering off into whitespace; `disable_any_whitespace` allows
    none (compact JSON).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams: give exactly one of json, regex, choice, grammar, json_object; "
                             f"got {given or 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"StructuredOutputsParams: json is not valid JSON ({e})") from None
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"StructuredOutputsParams: json must be a JSON schema (an object), got {schema!r:.80}")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"StructuredOutputsParams: {name} must be a string, got {getattr(self, name)!r:.80}")
        if self.choice is not None:
            choices = _strings("choice", self.choice, "a list of strings", where="StructuredOutputsParams")
            if not choices or "" in choices:
                raise ValueError(f"StructuredOutputsParams: choice must be a list of non-empty strings, got {choices!r:.80}")
            object.__setattr__(self, "choice", choices)
        check_bool("StructuredOutputsParams", "disable_any_whitespace", self.disable_any_whitespace)


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        where = "SamplingParams"
        self._set("n", check_int(where, "n", self.n, 1))
        self._set("max_tokens", check_int(where, "max_tokens", self.max_tokens, 1, optional=True))
        self._set("min_tokens", check_int(where, "min_tokens", self.min_tokens, 0))
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            self._set(name, check_real(where, name, getattr(self, name)))
        if self.temperature < 0.0:
            _bad(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            _bad(f"top_p must be in (0, 1], got {self.top_p}")
        self._set("top_k", check_int(where, "top_k", self.top_k))
        if self.top_k < -1 or self.top_k == 0:
            _bad(f"top_k must be -1 (disabled) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            _bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            _bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            _bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0.0:
            _bad(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        self._set("seed", check_int(where, "seed", self.seed, 0, optional=True))
        if self.seed is not None and self.seed + self.n - 1 >= 2**64:
            what = "seed" if self.n == 1 else f"seed + n - 1 (completion i uses seed + i; n={self.n})"
            _bad(f"{what} must be below 2**64, got seed={self.seed}")
        for name in ("logprobs", "prompt_logprobs"):
            value = self._set(name, check_int(where, name, getattr(self, name), optional=True))
            if value is not None and value < -1:
                _bad(f"{name} must be -1 (whole vocabulary) or >= 0, got {value}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            check_bool(where, name, getattr(self, name))
        self._check_lists()
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            _bad(f"structured_outputs must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}")

    def _check_lists(self) -> None:
        where = "SamplingParams"
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                _bad(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r:.80}")
            ids = token_ids(where, "logit_bias", self.logit_bias.keys())
            self._set("logit_bias", dict(zip(ids, (check_real(where, "a logit_bias value", v) for v in self.logit_bias.values()))))
        if self.allowed_token_ids is not None:
            if not self._set("allowed_token_ids", token_ids(where, "allowed_token_ids", self.allowed_token_ids)):
                _bad("allowed_token_ids must not be empty (leave it None to allow every token)")
        if self.stop_token_ids is not None:
            self._set("stop_token_ids", token_ids(where, "stop_token_ids", self.stop_token_ids))
        if self.stop is not None:
            stop = self.stop
            self._set("stop", check_text(where, "stop", stop) if isinstance(stop, str)
                      else _strings("stop", stop, "a string or a list of strings"))
            if "" in self.stop_strings:
                _bad("stop strings must not be empty")
        if self.bad_words is not None:
            words = self._set("bad_words", _strings("bad_words", self.bad_words))
            if any(not word.strip() for word in words):
                _bad(f"bad_words must not hold an empty word, got {words!r:.80}")
        if self.bad_words_token_ids is not None:
            if isinstance(self.bad_words_token_ids, (str, bytes)) or not isinstance(self.bad_words_token_ids, Iterable):
                _bad(f"bad_words_token_ids must be a list of token-id lists, got {self.bad_words_token_ids!r:.80}")
            words = self._set("bad_words_token_ids",
                              [token_ids(where, "bad_words_token_ids", w) for w in self.bad_words_token_ids])
            if any(not word for word in words):
                _bad("bad_words_token_ids must not hold an empty word")

    def _set(self, name: str, value: object) -> object:
        """Store the checked, normalised value (numpy ints as ints, tuples as lists) in the frozen field."""
        object.__setattr__(self, name, value)
        return value

    def verify(self, vocab_size: int, max_logprobs: int) -> None:
        """Raise a ValueError for what only the model and engine settings can rule out.

        `max_logprobs` is the engine's limit (-1: the whole vocabulary); a request's -1 means the
        whole vocabulary, as in vLLM.
        """
        limit = vocab_size if max_logprobs == -1 else max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            wanted = vocab_size if value == -1 else value
            if value is not None and wanted > limit:
                _bad(f"{name}={value} asks for {wanted} logprobs, more than the engine's maximum of {limit}")
        for name, ids in self._token_id_lists():
            outside = [t for t in ids if t >= vocab_size]
            if outside:
                _bad(f"{name} holds token ids {outside[:5]} outside the vocabulary (size {vocab_size})")
        if self.bad_words and self.bad_words_token_ids is None:
            _bad("bad_words must be tokenized first: use params.with_bad_words_tokenized(tokenizer)")

    def with_bad_words_tokenized(self, tokenizer: Tokenizer) -> SamplingParams:
        """A copy whose `bad_words_token_ids` holds each bad word's ids, as vLLM derives them.

        Every word is encoded as written (leading spaces stripped) and, to catch it in the middle of
        text too, with one leading space when that gives a different first token but the same length.
        """
        words: list[list[int]] = []
        for word in self.bad_words or []:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            words.append(plain)
            if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
                words.append(spaced)
        return replace(self, bad_words_token_ids=words)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def _token_id_lists(self) -> list[tuple[str, list]]:
        return [
            ("logit_bias", list(self.logit_bias or {})),
            ("allowed_token_ids", list(self.allowed_token_ids or [])),
            ("stop_token_ids", list(self.stop_token_ids or [])),
            ("bad_words_token_ids", [t for word in self.bad_words_token_ids or [] for t in word]),
        ]


def _bad(msg: str) -> None:
    raise ValueError(f"SamplingParams: {msg}")


def _strings(name: str, values: object, what: str = "a list of strings", where: str = "SamplingParams") -> list[str]:
    if isinstance(values, str) or not isinstance(values, Iterable) or not all(isinstance(s, str) for s in values):
        raise ValueError(f"{where}: {name} must be {what}, got {values!r:.80}")
    return [check_text(where, name, s) for s in values]
