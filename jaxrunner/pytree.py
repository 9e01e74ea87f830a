"""Frozen dataclasses that are JAX pytrees: every field is a leaf (or a sub-pytree), except fields
declared with `static_field()`, which are part of the tree's structure (hashable options)."""

from __future__ import annotations

import dataclasses
from typing import TypeVar

import jax

T = TypeVar("T")


def static_field() -> dataclasses.Field:
    return dataclasses.field(metadata={"static": True})


def pytree_dataclass(cls: type[T]) -> type[T]:
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)
    return jax.tree_util.register_dataclass(
        cls,
        data_fields=[f.name for f in fields if not f.metadata.get("static")],
        meta_fields=[f.name for f in fields if f.metadata.get("static")],
    )
