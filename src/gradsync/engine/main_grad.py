"""``reduce_dtype``: accumulate and reduce gradients of low-precision parameters in a wider dtype.

With ``reduce_dtype`` every bucket buffer has that dtype and is also the accumulation buffer of
the window: each gradient is added into its parameter's slot (``param.main_grad``) as soon as
it is ready, in every backward, and ``.grad`` is released. A parameter's first gradient after
a synced backward replaces its slot (the previous average) instead of adding to it, so a
``.grad`` the user did not zero is carried over as in torch. After a synced backward the slot
holds the average and ``.grad`` is its copy in the parameter's dtype. ``MainGrads`` is owned by
a bucket store, which tells it where each parameter's slot is (``slot(i)``).
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch

from .._torch import stamp, unchanged
from .checks import check_grad
from .quiet import hook_slots


class MainGrads:
    """The window's accumulation slots of a store built with ``reduce_dtype``."""

    def __init__(self, params: Sequence[torch.Tensor], names: Sequence[str], slot: Callable[[int], torch.Tensor],
                 *, world_size: int, grad_is_slot: bool):
        self.params, self.names, self.slot = params, names, slot
        self.world_size = world_size
        self.grad_is_slot = grad_is_slot  # gradient_as_bucket_view: ``.grad`` may be the slot itself
        n = len(params)
        self.fresh = [True] * n  # the next gradient starts a new window (replaces the slot)
        self._written: list[tuple[weakref.ref, int] | None] = [None] * n  # stamp() of the .grad written back
        me = weakref.ref(self)
        self.handles = [p.register_hook(_pre_hook(me, i)) for i, p in enumerate(params)]
        self.pre_hooks = hook_slots(params, self.handles, pre=True)  # quiet.keep_last keeps each hook last

    def release(self) -> None:
        """The wrapper is gone: gradients stay in ``.grad`` from now on, and its buckets go with it (a ``main_grad``
        left on a parameter kept them alive; one a newer wrapper set stays)."""
        for h in self.handles:
            h.remove()
        self.handles, self.pre_hooks = [], ([], [], [])
        for i, p in enumerate(self.params):
            if getattr(p, "main_grad", None) is not None and p.main_grad is self.slot(i):
                del p.main_grad

    def forget_window(self) -> None:
        """Every slot starts a new window at its next gradient (the window's sums are dropped)."""
        self.fresh = [True] * len(self.params)

    def _start_slot(self, i: int) -> None:
        """Begin parameter ``i``'s window: its slot starts from ``.grad`` (None: zero), exactly
        (the fp32 average) when ``.grad`` is still the untouched copy written at the last sync."""
        p, view = self.params[i], self.slot(i)
        written = self._written[i]
        if p.grad is None:
            view.zero_()
        elif not unchanged(written, p.grad):
            check_grad(p.grad, torch.empty_like(p, device="meta"), self.names[i])
            view.copy_(p.grad.detach())
        self.fresh[i] = False

    @torch.no_grad()
    def add(self, i: int, grad: torch.Tensor) -> None:
        """Add a gradient of parameter ``i``, as autograd delivers it, into its slot."""
        if grad.requires_grad:
            raise RuntimeError(
                f"gradsync: backward(create_graph=True) with reduce_dtype={self.slot(i).dtype}: each gradient is "
                "summed into its reduce_dtype slot (param.main_grad) outside autograd, so .grad could not carry "
                "the graph that a penalty on it differentiates through. Use reduce_dtype=None for a double backward.")
        if self.fresh[i]:
            self._start_slot(i)
        self.slot(i).add_(grad.detach())

    def release_grad(self, i: int) -> None:
        """After autograd accumulated into ``.grad``: the slot already holds it, so free it."""
        if self.fresh[i]:
            self._start_slot(i)
        self.params[i].grad = None

    def copy_in(self, i: int, divide: bool) -> None:
        """Synced backward: make parameter ``i``'s slot hold this rank's window sum, ready to reduce."""
        self.release_grad(i)
        if divide:  # as the default store averages a copied gradient (bucket.average): the same bits
            self.slot(i).mul_(1.0 / self.world_size)

    def write_back(self, i: int, view: torch.Tensor) -> None:
        p = self.params[i]
        if self.grad_is_slot and p.dtype == view.dtype:
            p.grad = view
        else:
            p.grad = view.to(p.dtype, copy=True)
        self._written[i] = stamp(p.grad)

    def link(self, views: Sequence[torch.Tensor], old_views: Sequence[torch.Tensor] | None) -> None:
        """Point ``param.main_grad`` at the (new) slots, keeping their values across a re-plan."""
        for i, p in enumerate(self.params):
            if old_views is not None:
                views[i].copy_(old_views[i])
            p.main_grad = views[i]

    def state(self) -> tuple[dict[str, torch.Tensor], list[str]]:
        """Return the window's accumulated slots, keyed by parameter name, and the names of those that hold the
        average of the last synced backward whose ``.grad`` copy is untouched (the next gradient starts from it
        exactly: a ``sync_each_batch`` window's earlier micro-steps)."""
        written = [i for i in range(len(self.params)) if self.fresh[i] and unchanged(self._written[i], self.params[i].grad)]
        kept = [i for i in range(len(self.params)) if not self.fresh[i]] + written
        return {self.names[i]: self.slot(i).clone() for i in kept}, [self.names[i] for i in written]

    def load_state(self, main: dict[str, torch.Tensor], written: Sequence[str] = ()) -> None:
        """Restore ``state()``; load ``.grad`` first (a written slot's ``.grad`` is its untouched copy)."""
        for i, name in enumerate(self.names):
            self.fresh[i] = name not in main or name in written
            self._written[i] = stamp(self.params[i].grad) if name in written and self.params[i].grad is not None \
                else None
            if name in main:
                self.slot(i).copy_(main[name])


def _pre_hook(main: weakref.ref, i: int) -> Callable[[torch.Tensor], None]:
    def hook(grad: torch.Tensor) -> None:
        me = main()
        if me is not None and me.handles and grad is not None:  # None: a custom backward gave it no gradient
            me.add(i, grad)
    return hook


__all__ = ["MainGrads"]
