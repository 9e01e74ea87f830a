"""Checks of what users hand in (sampling parameters, engine arguments, prompts, scheduler outputs).

Each raises one ValueError that names the object and the field, so a bad value never travels on to
fail deep inside JAX or, worse, to be truncated silently (2.5 tokens, True as a token id).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable


def is_int(value: object) -> bool:
    """An integer, numpy's included; not a bool (True is an int to Python, never a count or an id)."""
    return type(value) is int or (isinstance(value, numbers.Integral) and not isinstance(value, bool))


def all_ints(values: list) -> bool:
    """Whether every value is an integer; a plain list of ints (a prompt, say) takes the fast path."""
    return all(type(v) is int for v in values) or all(map(is_int, values))


def is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_int(where: str, name: str, value: object, low: int | None = None, *, optional: bool = False) -> int | None:
    """`value` as an int; ValueError unless it is an integer >= `low` (or None, when `optional`)."""
    if value is None and optional:
        return None
    if not is_int(value):
        raise ValueError(f"{where}: {name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{where}: {name} must be at least {low}, got {value}")
    return int(value)


def check_real(where: str, name: str, value: object) -> float:
    """`value` as a float; ValueError unless it is a finite real number."""
    if not is_real(value) or not math.isfinite(value):
        raise ValueError(f"{where}: {name} must be a finite number, got {value!r}")
    return float(value)


def check_bool(where: str, name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{where}: {name} must be True or False, got {value!r}")
    return value


def check_text(where: str, name: str, text: str) -> str:
    """`text` unless it holds a lone surrogate (a JSON escape such as "\\ud800", or bytes that were not
    UTF-8 in a command line): no tokenizer can encode one, and the tokenizers' own errors say nothing."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{where}: {name} is not valid Unicode text ({e.reason} at character {e.start}); "
                         "send UTF-8 text without lone surrogates") from None
    return text


def token_ids(where: str, name: str, values: object) -> list[int]:
    """A sequence of token ids (non-negative integers, numpy's included) as a list of ints."""
    if isinstance(values, (str, bytes, dict)) or not isinstance(values, Iterable):
        raise ValueError(f"{where}: {name} must be a list of token ids, got {values!r:.80}")
    ids = list(values)
    if all(type(t) is int for t in ids) and (not ids or min(ids) >= 0):
        return ids
    if wrong := [t for t in ids if not is_int(t) or t < 0]:
        raise ValueError(f"{where}: {name} holds invalid token ids {wrong[:5]}: token ids are non-negative integers")
    return [int(t) for t in ids]
