"""Structured output: requests whose text must follow a grammar (vLLM's structured outputs), on llguidance.

A request's `StructuredOutputsParams` becomes an llguidance grammar (`grammar_spec`), which
`GrammarCompiler` compiles on a thread pool, off the step path, once per grammar text: `compile`
returns a future of a template matcher, and each request follows the grammar with a copy of it
(`Grammar`). For each step the scheduler asks `fill_bitmask` for the masks of the structured
requests it scheduled, once the grammars took the tokens of the steps before: one row of
ceil(V / 32) int32 words per token the request may sample (its next token, then one after each of
its drafts), bit j of word i allowing token 32 i + j. The runner applies
them on the device before every other logits processor. EOS is in a mask only where the grammar
accepts the text so far, and a grammar that can take no more tokens ends its request.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np

from jaxrunner.sampling_params import StructuredOutputsParams

# Grammar texts whose compiled templates are kept (the oldest is dropped past this).
MAX_CACHED_GRAMMARS = 512


def grammar_spec(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a structured-output request (choices are a Lark alternation of literals)."""
    if params.json is not None or params.json_object:
        schema = params.json if params.json is not None else {"type": "object"}
        options = {"whitespace_flexible": not params.disable_any_whitespace}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if params.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
    return llguidance.LLMatcher.grammar_from_lark(params.grammar)


class Grammar:
    """One request's place in its grammar; advanced by every token the request keeps."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        """Advance past `token`; False if the grammar does not allow it (the matcher then stays in error)."""
        return self.matcher.consume_token(token)

    @property
    def stopped(self) -> bool:
        """Whether the grammar can take no more tokens (it matched completely, or took EOS)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()

    def valid_drafts(self, drafts: Sequence[int]) -> list[int]:
        """The longest prefix of `drafts` the grammar allows from here."""
        return list(drafts[: self.matcher.validate_tokens(list(drafts))])


class GrammarCompiler:
    """Compiles grammars for one tokenizer on a thread pool (llguidance drops the GIL while it
    works). The llguidance tokenizer is built from the Hugging Face one on first use, on the pool
    too; `vocab_size` is the model's (its logits' width), and every EOS id of the model is allowed
    where the grammar accepts."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int], max_workers: int = 4) -> None:
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar")
        self._hf_tokenizer, self._vocab_size, self._eos = tokenizer, vocab_size, list(eos_token_ids)
        self._tokenizer: Future | None = None
        self._templates: dict[str, Future] = {}

    def compile(self, params: StructuredOutputsParams) -> Future:
        """A future of the grammar's template matcher (its exception: a ValueError that says why
        the grammar does not compile). Copy it per request with `new_grammar`."""
        try:
            text = grammar_spec(params)
        except ValueError as e:  # llguidance rejects a schema that is not a JSON object here
            failed = Future()
            failed.set_exception(ValueError(f"the JSON schema is not valid: {e}"))
            return failed
        if text not in self._templates:
            if self._tokenizer is None:
                self._tokenizer = self._pool.submit(self._ll_tokenizer)
            if len(self._templates) >= MAX_CACHED_GRAMMARS:
                self._templates.pop(next(iter(self._templates)))
            self._templates[text] = self._pool.submit(self._compile, text)
        return self._templates[text]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        if len(self._hf_tokenizer) > self._vocab_size:
            raise ValueError(f"the tokenizer has {len(self._hf_tokenizer)} tokens, more than the model's "
                             f"{self._vocab_size}: structured outputs need a tokenizer that matches the model")
        try:
            tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self._vocab_size, eos_token=self._eos)
        except ValueError:  # a decoder llguidance does not read (not byte-level): each token as its text
            wrapper = llguidance.TokenizerWrapper(_TextTokens(self._hf_tokenizer, self._vocab_size))
            tokenizer = llguidance.LLTokenizer(wrapper, eos_token=self._eos)
        if tokenizer.vocab_size != self._vocab_size:  # the masks must be as wide as the logits
            raise ValueError(f"llguidance read {tokenizer.vocab_size} tokens from the tokenizer, the model has "
                             f"{self._vocab_size}: structured outputs need a tokenizer that matches the model")
        return tokenizer

    def _compile(self, text: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self._tokenizer.result(), text, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the grammar does not compile: {' '.join(matcher.get_error().split())}")
        return matcher


class _TextTokens:
    """A tokenizer whose every token decodes to whole characters (the tiny model's), in the form
    llguidance's `TokenizerWrapper` reads: each token's bytes, and an encoder. Ids past the
    tokenizer, up to the model's `vocab_size`, are special tokens no grammar allows."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id, self.bos_token_id = tokenizer.eos_token_id, tokenizer.bos_token_id
        texts = [tokenizer.decode([i]) for i in range(len(tokenizer))]
        if broken := [i for i, t in enumerate(texts) if "\ufffd" in t]:
            raise ValueError(f"structured outputs cannot read this tokenizer: llguidance does not know its decoder, "
                             f"and tokens such as {broken[:3]} are parts of characters; use a byte-level BPE tokenizer")
        unused = range(len(texts), vocab_size)
        self.tokens = [t.encode() for t in texts] + [f"<unused_{i}>".encode() for i in unused]
        self.special_token_ids = [*tokenizer.all_special_ids, *unused]

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)


def new_grammar(template: llguidance.LLMatcher) -> Grammar:
    return Grammar(template.deep_copy())


@functools.cache
def _executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor()


def fill_bitmask(requests: Sequence[tuple[Grammar | None, Sequence[int]]], vocab_size: int) -> np.ndarray:
    """The masks of a step: for each (grammar, drafts), 1 + len(drafts) rows, one for the next token
    and one after each draft (the drafts must be valid: see `Grammar.valid_drafts`); filled in
    parallel. A None grammar's rows allow every token."""
    rows = np.cumsum([0] + [1 + len(drafts) for _, drafts in requests])
    mask = llguidance.numpy.allocate_token_bitmask(int(rows[-1]), vocab_size)
    entries = [(g.matcher, int(row), list(drafts)) for (g, drafts), row in zip(requests, rows) if g is not None]
    if plain := [(m, row) for m, row, drafts in entries if not drafts]:
        llguidance.numpy.fill_next_token_bitmask_par(_executor(), plain, mask)
    if drafted := [e for e in entries if e[2]]:  # llguidance wants these apart
        llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(_executor(), drafted, mask)
    return mask
