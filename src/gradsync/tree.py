"""Nested batches and outputs: flatten tuples, lists, namedtuples and dicts to leaves and back; split rows."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def flatten(obj: Any) -> tuple[list[Any], Any]:
    """Return the leaves of nested tuples, lists and dicts, and a spec to rebuild the structure."""
    leaves: list[Any] = []
    return leaves, _walk(obj, leaves)


# Module-level recursion on purpose: a recursive closure is a reference cycle that would keep
# the leaves (chunk outputs and their autograd graphs) alive until the garbage collector runs.
def _walk(obj: Any, leaves: list[Any]) -> Any:
    if isinstance(obj, (tuple, list)):
        return (type(obj), [_walk(v, leaves) for v in obj])
    if isinstance(obj, dict):
        return (type(obj), list(obj.keys()), [_walk(v, leaves) for v in obj.values()])
    leaves.append(obj)
    return None


def unflatten(leaves: list[Any], spec: Any) -> Any:
    """Rebuild the structure ``flatten`` returned ``spec`` for, with ``leaves`` in its places."""
    return _build(spec, iter(leaves))


def _build(spec: Any, it: Iterator[Any]) -> Any:
    if spec is None:
        return next(it)
    if len(spec) == 2:
        items = [_build(c, it) for c in spec[1]]
        namedtuple = issubclass(spec[0], tuple) and hasattr(spec[0], "_fields")
        return spec[0](*items) if namedtuple else spec[0](items)
    return spec[0](zip(spec[1], [_build(c, it) for c in spec[2]]))


def row_bounds(rows: int, parts: int) -> list[tuple[int, int]]:
    """(start, length) of ``parts`` row ranges covering ``rows``, as even as ``tensor_split`` makes them."""
    sizes = [len(r) for r in torch.arange(rows).tensor_split(parts)]
    return [(sum(sizes[:k]), size) for k, size in enumerate(sizes)]


def narrow(obj: Any, start: int, length: int) -> Any:
    """Rows ``start:start + length`` of a tensor with a dim 0; anything else as it is."""
    return obj.narrow(0, start, length) if isinstance(obj, torch.Tensor) and obj.dim() > 0 else obj
