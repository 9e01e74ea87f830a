"""Frozen dataclasses that are JAX pytrees: every field is a leaf (or a sub-pytree)."""

from __future__ import annotations

import dataclasses
from typing import TypeVar

import jax

T = TypeVar("T")


def pytree_dataclass(cls: type[T]) -> type[T]:
    cls = dataclasses.dataclass(frozen=True)(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    return jax.tree_util.register_dataclass(cls, data_fields=names, meta_fields=[])
