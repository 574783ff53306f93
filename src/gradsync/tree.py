"""Nested batches and outputs: tuples, lists, namedtuples, dicts and dataclasses to leaves and back; split rows."""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch


def flatten(obj: Any) -> tuple[list[Any], Any]:
    """Return the leaves of nested tuples, lists, dicts and dataclasses, and a spec to rebuild the structure.

    A dataclass is rebuilt from its ``init`` fields, as ``dataclasses.replace`` does: its other fields are
    left to its defaults and ``__post_init__``. Specs compare equal when the structures are the same.
    """
    leaves: list[Any] = []
    return leaves, _walk(obj, leaves)


@dataclasses.dataclass(frozen=True)
class _Node:
    kind: type
    keys: tuple[Any, ...] | None  # dict keys, dataclass field names; None for a sequence
    children: tuple[Any, ...]
    factory: Any = dataclasses.field(default=None, compare=False)  # a defaultdict's: a new lambda per call is alike


# Module-level recursion on purpose: a recursive closure is a reference cycle that would keep
# the leaves (chunk outputs and their autograd graphs) alive until the garbage collector runs.
def _walk(obj: Any, leaves: list[Any]) -> Any:
    if isinstance(obj, (tuple, list)):
        return _Node(type(obj), None, tuple(_walk(v, leaves) for v in obj))
    if isinstance(obj, dict):  # before dataclasses: Hugging Face's ModelOutput is both, rebuilt as a dict
        factory = obj.default_factory if isinstance(obj, defaultdict) else None
        return _Node(type(obj), tuple(obj.keys()), tuple(_walk(v, leaves) for v in obj.values()), factory)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = tuple(f.name for f in dataclasses.fields(obj) if f.init)
        return _Node(type(obj), names, tuple(_walk(getattr(obj, n), leaves) for n in names))
    leaves.append(obj)
    return None


def unflatten(leaves: list[Any], spec: Any) -> Any:
    """Rebuild the structure ``flatten`` returned ``spec`` for, with ``leaves`` in its places."""
    return _build(spec, iter(leaves))


def _build(spec: Any, it: Iterator[Any]) -> Any:
    if spec is None:
        return next(it)
    items = [_build(c, it) for c in spec.children]
    if spec.keys is None:
        namedtuple = issubclass(spec.kind, tuple) and hasattr(spec.kind, "_fields")
        return spec.kind(*items) if namedtuple else spec.kind(items)
    if issubclass(spec.kind, dict):
        pairs = zip(spec.keys, items)
        return spec.kind(spec.factory, pairs) if issubclass(spec.kind, defaultdict) else spec.kind(pairs)
    return spec.kind(**dict(zip(spec.keys, items)))


def row_bounds(rows: int, parts: int) -> list[tuple[int, int]]:
    """(start, length) of ``parts`` row ranges covering ``rows``, as even as ``tensor_split`` makes them."""
    sizes = [len(r) for r in torch.arange(rows).tensor_split(parts)]
    return [(sum(sizes[:k]), size) for k, size in enumerate(sizes)]


def narrow(obj: Any, start: int, length: int) -> Any:
    """Rows ``start:start + length`` of a tensor with a dim 0; anything else as it is."""
    return obj.narrow(0, start, length) if isinstance(obj, torch.Tensor) and obj.dim() > 0 else obj
