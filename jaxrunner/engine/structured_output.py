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
import llguidance.numpy
import numpy as np

from jaxrunner.sampling_params import StructuredOutputsParams

# Grammar texts whose compiled templates are kept (the oldest is dropped past this).
MAX_CACHED_GRAMMARS = 512
# llguidance's own limits on a grammar's size and on the work of a step, with errors kept short: its
# verbose ones carry the parser's state and the whole grammar.
LIMITS = llguidance.LLParserLimits(verbose_errors=False)
# The whitespace JSON may hold between two of its tokens: one line break, then indentation (four
# levels of it, in spaces or tabs). Under llguidance's default, any run of whitespace, a small model
# can write whitespace until max_tokens.
JSON_WHITESPACE = r"(\r?\n)?( {0,16}|\t{0,4})"
# Pieces of llguidance's errors that mean a grammar went past one of its limits, and that limit.
LIMIT_ERRORS = {
    "too many expressions constructed": "lexer work limit",
    "fuel exhausted": "lexer work limit",
    "lexer precomputation failed": "lexer work limit",
    "initial lexer configuration (grammar) too big": "lexer size limit",
    "too many states": "lexer state limit",
    "items; max is": "limit on the rules a parser row holds",
    "Too many items": "parser work limit",
    "grammar size (number of symbols) too big": "grammar size limit",
}
# How a grammar of each kind keeps within those limits.
SMALLER = {
    "JSON schema": "smaller maxLength, maxItems and enums, and simpler patterns",
    "regex": "smaller repetition counts (such as {n}) and fewer alternatives",
    "choice list": "fewer or shorter choices",
    "grammar": "fewer alternatives in a rule and smaller repetition counts",
}
# Errors quote at most this much of llguidance's message (which may quote the grammar).
MAX_QUOTED = 200


def grammar_spec(params: StructuredOutputsParams) -> tuple[str, str]:
    """The kind of a structured-output request's grammar, as errors name it, and its llguidance
    grammar. Choices are one Lark terminal, so that the lexer, not the parser, tells them apart:
    the parser holds every alternative of a rule at once, and stops at a few thousand."""
    if params.json is not None or params.json_object:
        schema = {"type": "object"} if params.json is None else params.json
        if isinstance(schema, str):
            schema = json.loads(schema)
        if params.disable_any_whitespace:
            options = {"whitespace_flexible": False}
        elif _sets_whitespace(schema):
            options = {}
        else:
            options = {"whitespace_pattern": JSON_WHITESPACE}
        try:
            return "JSON schema", llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except ValueError as e:  # llguidance rejects a schema that is not a JSON object here
            raise ValueError(f"the JSON schema is not valid: {_quoted(str(e))}") from None
    if params.regex is not None:
        return "regex", llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        return "choice list", llguidance.LLMatcher.grammar_from_lark(
            "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in params.choice))
    return "grammar", llguidance.LLMatcher.grammar_from_lark(params.grammar)


def _sets_whitespace(schema) -> bool:
    """Whether a schema's own llguidance options (`x-guidance`) set whitespace_flexible, which a
    default whitespace_pattern would override."""
    options = schema.get("x-guidance") if isinstance(schema, dict) else None
    return isinstance(options, dict) and "whitespace_flexible" in options


def _quoted(error: str) -> str:
    text = " ".join(error.replace("<non-verbose/>", "").split())
    return text if len(text) <= MAX_QUOTED else text[:MAX_QUOTED] + "..."


def _limit(error: str) -> str | None:
    return next((limit for piece, limit in LIMIT_ERRORS.items() if piece in error), None)


def _compile_error(kind: str, error: str) -> str:
    """What to tell the user about a grammar that llguidance failed on with `error`."""
    limit = _limit(error)
    if limit is None:
        return f"the {kind} does not compile: {_quoted(error)}"
    return f"the {kind} goes past llguidance's {limit} ({_quoted(error)}): use {SMALLER[kind]}"


class Grammar:
    """One request's place in its grammar; advanced by every token the request keeps."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        """Advance past `token`; False if the grammar does not allow it, or failed before (the
        matcher then stays in error). A failed matcher's masks allow EOS alone, and it takes EOS."""
        return self.matcher.consume_token(token) and not self.matcher.is_error()

    @property
    def stopped(self) -> bool:
        """Whether the grammar can take no more tokens (it matched completely, or took EOS)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        error = self.matcher.get_error()
        limit = _limit(error)
        return _quoted(error) if limit is None else f"{_quoted(error)}; past llguidance's {limit}"

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
            kind, text = grammar_spec(params)
        except ValueError as e:
            failed = Future()
            failed.set_exception(e)
            return failed
        if text not in self._templates:
            if self._tokenizer is None:
                self._tokenizer = self._pool.submit(self._ll_tokenizer)
            if len(self._templates) >= MAX_CACHED_GRAMMARS:
                self._templates.pop(next(iter(self._templates)))
            self._templates[text] = self._pool.submit(self._compile, kind, text)
        return self._templates[text]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        import llguidance.hf  # imports transformers: not at `import jaxrunner` (see `cli.console_main`)

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

    def _compile(self, kind: str, text: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self._tokenizer.result(), text, log_level=0, limits=LIMITS)
        error = matcher.get_error() or self._first_token_error(matcher)
        if error:
            raise ValueError(_compile_error(kind, error))
        return matcher

    def _first_token_error(self, matcher: llguidance.LLMatcher) -> str:
        """llguidance builds the lexer for the first mask, and a lexer that ran out of its limits
        there shows only at the next token: the template takes its first mask (which the step path
        then does not pay for) and a copy the first token it allows, so that such a grammar fails
        here, before any request runs on it."""
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")
        allowed = np.setdiff1d(np.flatnonzero(bits), self._eos)
        if matcher.is_error() or not allowed.size:
            return matcher.get_error()
        trial = matcher.deep_copy()
        trial.consume_token(int(allowed[0]))
        return trial.get_error()


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
