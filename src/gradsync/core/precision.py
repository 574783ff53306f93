"""``reduce_dtype``: accumulate and reduce gradients of low-precision parameters in a wider dtype.

With ``reduce_dtype`` every bucket buffer has that dtype and is also the accumulation buffer of
the window: each gradient is added into its parameter's slot (``param.main_grad``) as soon as
it is ready, in every backward, and ``.grad`` is released. A parameter's first gradient after
a synced backward replaces its slot (the previous average) instead of adding to it, so a
``.grad`` the user did not zero is carried over as in torch. After a synced backward the slot
holds the average and ``.grad`` is its copy in the parameter's dtype. ``MainGrad`` expects the
storage's ``params``, ``names``, ``buckets``, ``_views``, ``comm_hook``, ``world_size`` and
``gradient_as_bucket_view``.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._torch import version
from .control import check_grad


def resolve_reduce_dtype(reduce_dtype: Any, params: Sequence[torch.Tensor]) -> torch.dtype | None:
    """Return ``reduce_dtype`` after checking it is a floating dtype at least as wide as every parameter's."""
    if reduce_dtype is None:
        return None
    if not isinstance(reduce_dtype, torch.dtype) or not reduce_dtype.is_floating_point:
        raise TypeError(f"gradsync: reduce_dtype must be a floating-point torch.dtype such as torch.float32, "
                        f"got {reduce_dtype!r}")
    complex_ = sorted({str(p.dtype) for p in params if p.is_complex()})
    if complex_:
        raise ValueError(f"gradsync: reduce_dtype applies to real floating-point parameters, and the model has "
                         f"{', '.join(complex_)} parameters; their gradients reduce in their own dtype: pass "
                         "reduce_dtype=None")
    narrower = sorted({str(p.dtype) for p in params if torch.promote_types(p.dtype, reduce_dtype) != reduce_dtype})
    if narrower:
        raise ValueError(f"gradsync: reduce_dtype={reduce_dtype} cannot hold the gradients of {', '.join(narrower)} "
                         "parameters without losing precision; pass a dtype at least as wide as every "
                         "parameter's (e.g. torch.float32 for bf16/fp16 parameters), or None")
    return reduce_dtype


class MainGrad:
    reduce_dtype: torch.dtype | None = None
    divide_on_copy = True  # False where the launch divides the whole bucket (sharded)

    def _main_view(self, i: int) -> torch.Tensor:
        """Return parameter ``i``'s slot in its bucket buffer."""
        return self._views[i]

    def _has_local_grad(self, i: int) -> bool:
        return self.params[i].grad is not None or (self.reduce_dtype is not None and not self._fresh[i])

    def _install_main_hooks(self) -> None:
        me = weakref.ref(self)
        self._written: list[tuple[weakref.ref, int] | None] = [None] * len(self.params)
        for i, p in enumerate(self.params):
            p.register_hook(_pre_hook(me, i))

    def _start_slot(self, i: int) -> None:
        """Begin parameter ``i``'s window: its slot starts from ``.grad`` (None: zero), exactly
        (the fp32 average) when ``.grad`` is still the untouched copy written at the last sync."""
        p, view = self.params[i], self._main_view(i)
        written = self._written[i]
        if p.grad is None:
            view.zero_()
        elif not (written is not None and written[0]() is p.grad and version(p.grad) == written[1]):
            check_grad(p.grad, torch.empty_like(p, device="meta"), self.names[i])
            view.copy_(p.grad.detach())
        self._fresh[i] = False

    @torch.no_grad()
    def _add_main(self, i: int, grad: torch.Tensor) -> None:
        """Add a gradient of parameter ``i``, as autograd delivers it, into its slot."""
        if self._fresh[i]:
            self._start_slot(i)
        self._main_view(i).add_(grad.detach())

    def _release_grad(self, i: int) -> None:
        """After autograd accumulated into ``.grad``: the slot already holds it, so free it."""
        if self._fresh[i]:
            self._start_slot(i)
        self.params[i].grad = None

    def _copy_main(self, i: int) -> None:
        """Synced backward: make parameter ``i``'s slot hold this rank's window sum, ready to reduce."""
        self._release_grad(i)
        if self.divide_on_copy and self.comm_hook is None:
            self._main_view(i).div_(self.world_size)

    def _write_back_main(self, i: int, view: torch.Tensor) -> None:
        p = self.params[i]
        if self.gradient_as_bucket_view and p.dtype == view.dtype:
            p.grad = view
        else:
            p.grad = view.to(p.dtype, copy=True)
        self._written[i] = (weakref.ref(p.grad), version(p.grad))

    def _link_main_grads(self, old_views: list[torch.Tensor] | None) -> None:
        """Point ``param.main_grad`` at the (new) slots, keeping their values across a re-plan."""
        if old_views is None:
            self._install_main_hooks()
        for i, p in enumerate(self.params):
            if old_views is not None:
                self._views[i].copy_(old_views[i])
            p.main_grad = self._views[i]

    def grad_tensors(self) -> list[torch.Tensor]:
        """Return the tensors holding gradients (``.grad`` and, with ``reduce_dtype``, the buckets), once each."""
        grads = [p.grad for i, p in enumerate(self.params) if p.grad is not None
                 and not (self.reduce_dtype is not None and p.grad.data_ptr() == self._views[i].data_ptr())]
        if self.reduce_dtype is not None:
            grads += [b.buffer for b in self.buckets if b.buffer is not None]
        return grads

    def main_grad_state(self) -> dict[str, torch.Tensor]:
        """Return the window's accumulated slots (``reduce_dtype`` only), keyed by parameter name."""
        return {self.names[i]: self._main_view(i).clone() for i in range(len(self.params))
                if self.reduce_dtype is not None and not self._fresh[i]}

    def load_main_grad_state(self, main: dict[str, torch.Tensor]) -> None:
        if main and self.reduce_dtype is None:
            raise ValueError("gradsync: this gradient state holds reduce_dtype accumulation buffers "
                             "('main_grads'); load it into a model built with the same reduce_dtype")
        for i, name in enumerate(self.names):
            if self.reduce_dtype is None:
                continue
            self._fresh[i] = name not in main
            if name in main:
                self._main_view(i).copy_(main[name])


def _pre_hook(storage: weakref.ref, i: int) -> Callable[[torch.Tensor], None]:
    def hook(grad: torch.Tensor) -> None:
        me = storage()
        if me is not None and me._handles:  # no _handles: the wrapper was superseded or removed
            me._add_main(i, grad)
    return hook
