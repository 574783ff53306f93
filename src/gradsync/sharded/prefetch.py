"""Deferred parameter all-gathers: ``ShardedOptimizer(..., prefetch=True)``.

``step()`` starts every bucket's all-gather and returns without waiting. Until they are waited,
a ``TorchFunctionMode`` on the stepping thread sees every torch function (module forwards, ``F.*``,
``.detach()``, ``.data``, ``.clone()``, indexing, ``state_dict()``, ...) and, before running it,
waits for the all-gathers of the buckets whose memory any tensor argument (or a tensor in a list
or tuple argument) lies in: parameters, views of them, ``.data``, the flat buffers. A tensor
without a data pointer (fake, sparse, a wrapper subclass) waits for all of them. Functions that
only read or set metadata (``.grad``, ``.shape``, ``.requires_grad``, ...) do not wait, so
``zero_grad()`` does not. Everything is waited, and the mode popped, at the end of the wrapper's
forward (before any backward), at the next ``step()``, the optimizer's ``state_dict()`` and
``load_state_dict()``, and by ``ShardedOptimizer.wait_for_params()``. Memory read without a torch
function (raw pointers taken before the step, ``torch.distributed`` calls on parameters) needs
``wait_for_params()`` first.

The mode is pushed only when the stack is empty (or already holds this one), so it never sits
between another mode's enter and exit; else, or under ``torch.compile`` tracing, ``step()`` waits
as without prefetch. The stack is per thread: a forward on another thread waits for everything
first. The backward's reduce-scatters start only after every all-gather is waited.
"""
from __future__ import annotations

import threading
from bisect import bisect_right
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .._torch import (pop_torch_function_mode, push_torch_function_mode, torch_function_disabled, torch_function_stack)

_GETTERS = ("grad", "requires_grad", "shape", "dtype", "device", "is_leaf", "grad_fn", "ndim", "layout",
            "is_cuda", "is_sparse", "is_meta", "is_quantized", "names", "_cdata")  # _cdata: the wrapper's TENSOR_IMPL
_METHODS = ("size", "dim", "numel", "nelement", "stride", "element_size", "is_contiguous", "is_floating_point",
            "is_complex", "requires_grad_", "register_hook", "register_post_accumulate_grad_hook", "__hash__")
# functions that touch no parameter memory: no wait
_METADATA = frozenset(
    [getattr(torch.Tensor, n).__get__ for n in _GETTERS if hasattr(torch.Tensor, n)]
    + [torch.Tensor.grad.__set__, torch.Tensor.requires_grad.__set__]
    + [getattr(torch.Tensor, n) for n in _METHODS if hasattr(torch.Tensor, n)])


def _stack() -> list[Any]:
    return torch_function_stack()


def compiling() -> bool:
    return torch.compiler.is_compiling()


class _WaitMode(TorchFunctionMode):
    def __init__(self, gathers: Gathers):
        super().__init__()
        self.gathers = gathers

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        gathers = self.gathers
        if gathers.works and func not in _METADATA:
            gathers.wait_for(args)
            if kwargs:
                gathers.wait_for(kwargs.values())
        return func(*args, **kwargs)


class Gathers:
    """The parameter all-gathers ``ShardedOptimizer.step()`` started and nobody waited for yet."""

    def __init__(self, reducer: Any):
        self.reducer = reducer
        self.works: dict[int, list[Any]] = {}  # bucket index -> its all-gather's works, while pending
        spans = sorted((b.flat_param.data_ptr(), b.flat_param.data_ptr() + b.flat_param.untyped_storage().nbytes(),
                        b.index) for b in reducer.buckets)
        self._starts = [s for s, _, _ in spans]
        self._spans = spans
        self._mode: _WaitMode | None = None
        self._thread: int | None = None

    @property
    def pending(self) -> list[int]:
        return sorted(self.works)

    def defer(self, works: dict[int, list[Any]]) -> bool:
        """Leave ``works`` pending behind the mode; return False (nothing deferred) where it cannot."""
        if not works or compiling() or torch_function_disabled():
            return False
        stack = _stack()
        if self._mode is None or self._thread != threading.get_ident() or self._mode not in stack:
            if stack:  # another mode's exit would pop ours
                return False
            self._mode, self._thread = _WaitMode(self), threading.get_ident()
            push_torch_function_mode(self._mode)
        self.works.update(works)
        return True

    @property
    def active(self) -> bool:
        """Something is pending, or a mode is still pushed."""
        return bool(self.works) or self._mode is not None

    def guards_this_thread(self) -> bool:
        return self._mode is not None and self._thread == threading.get_ident()

    def wait_for(self, args: Any) -> None:
        for a in args:
            if isinstance(a, torch.Tensor):
                self._wait_tensor(a)
            elif isinstance(a, (list, tuple)):
                for t in a:
                    if isinstance(t, torch.Tensor):
                        self._wait_tensor(t)

    def _wait_tensor(self, t: torch.Tensor) -> None:
        try:
            ptr = t.data_ptr()
        except Exception:  # no storage to compare: it may wrap a parameter
            self.wait_all()
            return
        k = bisect_right(self._starts, ptr) - 1
        if k >= 0 and ptr < self._spans[k][1] and self._spans[k][2] in self.works:
            self.wait_bucket(self._spans[k][2])

    def wait_bucket(self, index: int) -> None:
        for work in self.works.pop(index):
            self.reducer.wait(work, f"the parameter all-gather of bucket {index}")

    def wait_all(self) -> None:
        for index in sorted(self.works):
            self.wait_bucket(index)

    def finish(self) -> None:
        """Wait for everything; pop the mode if it is on top of this thread's stack."""
        self.wait_all()
        mode = self._mode
        if mode is not None and self._thread == threading.get_ident():
            if pop_torch_function_mode(mode):
                self._mode = self._thread = None


__all__ = ["Gathers"]
