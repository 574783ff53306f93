"""Which parameters a forward's outputs can reach: the autograd-graph walk behind find_unused_parameters."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def reachable_params(outputs: Any, index_of: dict[int, int]) -> set[int]:
    """Return the indices (``index_of[id(param)]``) of parameters the outputs' graphs reach."""
    stack = [t.grad_fn for t in tensors(outputs) if t.grad_fn is not None]
    seen: set = set()
    found: set[int] = set()
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)  # an AccumulateGrad node: a leaf, maybe a parameter
        if var is not None:
            i = index_of.get(id(var))
            if i is not None:
                found.add(i)
        stack.extend(nf for nf, _ in fn.next_functions if nf is not None)
    return found


def tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Yield the tensors in nested dicts, lists, tuples and dataclasses (a forward's outputs)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors(v)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            yield from tensors(getattr(obj, name))
