"""Bucket storage: flat buffers, per-parameter views, copy-in, write-back and the one-time re-plan.

``BucketStorage`` is the part of the reducer that owns memory. It expects the reducer's
``params``, ``names``, ``world_size``, ``group``, ``device``, bucket caps, ``comm_hook`` and
``gradient_as_bucket_view``; a subclass (the sharded reducer) replaces how buckets are laid out.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .buckets import plan_buckets
from .control import check_grad
from .precision import MainGrad


@dataclass
class Bucket:
    index: int
    members: list[int]  # parameter indices
    buffer: torch.Tensor
    views: list[torch.Tensor]  # per-member views of ``buffer``, shaped like the parameters
    pending: int = 0
    handle: Any = None  # dist.Work (default path) or torch.futures.Future (hook path)
    times: dict[str, float] = field(default_factory=dict)


def is_view_of(grad: torch.Tensor | None, view: torch.Tensor) -> bool:
    return grad is not None and grad.data_ptr() == view.data_ptr()


def _warn_create_graph() -> None:
    warnings.warn(
        "gradsync: backward(create_graph=True) with DistributedDataParallel: the gradients are "
        "averaged across ranks, but the higher-order graph is not (as in torch's DDP): gradients of "
        "the gradients stay rank-local.", stacklevel=3)


class BucketStorage(MainGrad):
    plan_order: list[int] | None = None  # rank 0's observed order, once the buckets were re-planned

    def _build_buckets(self, plan: list[list[int]]) -> None:
        old_views = getattr(self, "_views", None)
        self.buckets: list[Bucket] = []
        self._views: list[torch.Tensor] = [None] * len(self.params)  # type: ignore[list-item]
        self._bucket_of = [0] * len(self.params)
        for b, members in enumerate(plan):
            first = self.params[members[0]]
            total = sum(self.params[i].numel() for i in members)
            buffer = torch.zeros(total, dtype=self.reduce_dtype or first.dtype, device=first.device)
            views, offset = [], 0
            for i in members:
                p = self.params[i]
                view = buffer[offset:offset + p.numel()].view(p.shape)
                offset += p.numel()
                views.append(view)
                self._views[i] = view
                self._bucket_of[i] = b
            self.buckets.append(Bucket(b, list(members), buffer, views))
        if self.reduce_dtype is not None:
            self._link_main_grads(old_views)
        if self.gradient_as_bucket_view and old_views is not None:
            for i, p in enumerate(self.params):
                if is_view_of(p.grad, old_views[i]):
                    self._views[i].copy_(p.grad)
                    p.grad = self._views[i]

    def bucket_plan(self) -> list[list[int]]:
        """Return the current buckets as lists of parameter indices."""
        return [list(b.members) for b in self.buckets]

    def _bucket_nbytes(self, bucket: Bucket) -> int:
        return bucket.buffer.numel() * bucket.buffer.element_size()

    # ---------------------------------------------------------------- gradients in and out
    def _copy_to_bucket(self, i: int) -> None:
        grad = self.params[i].grad
        view = self._views[i]
        if grad is not None and grad.requires_grad:  # backward(create_graph=True)
            _warn_create_graph()
            grad = grad.detach()
        if self.reduce_dtype is not None:
            self._copy_main(i)
        elif grad is None:
            view.zero_()
        elif self.gradient_as_bucket_view:
            self._adopt_view(i, divide=self.comm_hook is None)
        else:
            check_grad(grad, view, self.names[i])
            if self.comm_hook is None:  # average while copying: saves a pass over the bucket (launcher)
                torch.div(grad, self.world_size, out=view)
            else:
                view.copy_(grad)

    def _keep_local(self, i: int) -> None:
        """Unsynced backward: keep parameter ``i``'s gradient for the next synced one."""
        if self.reduce_dtype is not None:
            self._release_grad(i)
        elif self.gradient_as_bucket_view:
            self._adopt_view(i)

    def _adopt_view(self, i: int, divide: bool = False) -> None:
        """Make ``.grad`` the bucket view again, keeping its value (copy if it was replaced).

        ``divide`` (a synced backward without a comm hook): average on the way, in the copy
        when there is one, so the bucket is never divided in a pass of its own.
        """
        p, view = self.params[i], self._views[i]
        grad = p.grad
        if grad is None:
            return
        if is_view_of(grad, view):
            if divide:
                view.div_(self.world_size)
            return
        check_grad(grad, view, self.names[i])
        if divide:
            torch.div(grad.detach(), self.world_size, out=view)
        else:
            view.copy_(grad.detach())
        p.grad = view

    @torch.no_grad()  # a create_graph backward runs this with grad mode on: record nothing
    def _write_back(self, bucket: Bucket, result: torch.Tensor, counts: list[int]) -> None:
        if result is not bucket.buffer:
            bucket.buffer.copy_(result.reshape(bucket.buffer.shape))
        for i, view in zip(bucket.members, bucket.views):
            self._fresh[i] = True  # the next gradient starts a new window
            if counts[i] == 0:  # unused on every rank: leave .grad as it was (None stays None)
                continue
            p = self.params[i]
            if self.reduce_dtype is not None:
                self._write_back_main(i, view)
            elif self.gradient_as_bucket_view:
                if not is_view_of(p.grad, view):
                    p.grad = view
            elif p.grad is None:
                p.grad = view.clone()
            else:
                p.grad.copy_(view)

    # ---------------------------------------------------------------- re-planning
    def _rebuild_buckets(self) -> None:
        """Re-plan buckets once from rank 0's observed gradient-ready order."""
        order = self._ready_order
        self._ready_order = None
        self._rebuilt = True
        if self.find_unused_parameters and not self.static_graph:
            return  # the order changes from iteration to iteration; keep registration order
        seen = set(order)
        order = list(dict.fromkeys(order)) + [i for i in reversed(range(len(self.params))) if i not in seen]
        shared = torch.tensor(order, dtype=torch.int64, device=self.device)
        self.wait(dist.broadcast(shared, src=dist.get_global_rank(self.group, 0), group=self.group,
                                  async_op=True), "the bucket rebuild")
        self.load_plan_order(shared.tolist())

    def load_plan_order(self, order: list[int]) -> None:
        """Plan the buckets from ``order`` (rank 0's observed gradient order) and never re-plan again.

        A resumed run must reduce with the layout the interrupted run had: with three or more
        ranks the ring all-reduce's summation order depends on where a gradient sits in its bucket.
        """
        self._ready_order = None
        self._rebuilt = True
        self.plan_order = list(order)
        plan = plan_buckets(self.params, self.bucket_cap_mb, self.first_bucket_cap_mb, order)
        if plan != self.bucket_plan():
            self._build_buckets(plan)

    # ---------------------------------------------------------------- checkpoints
    def grad_state(self) -> dict[str, Any]:
        order = self.plan_order
        state = {"gradients": {name: p.grad.detach().clone() for name, p in zip(self.names, self.params)
                               if p.grad is not None},
                 "bucket_order": None if order is None else [self.names[i] for i in order]}
        if self.reduce_dtype is not None:
            state["main_grads"] = self.main_grad_state()
        if self.auto_caps is not None and self.auto_caps.choice is not None:
            state["bucket_caps"] = [self.bucket_cap_mb, self.first_bucket_cap_mb]
        return state

    def load_grad_state(self, state: dict[str, Any]) -> None:
        if not {"gradients", "bucket_order"} <= set(state) <= {"gradients", "bucket_order", "main_grads",
                                                               "bucket_caps"}:
            raise KeyError("gradsync: expected a dict from model.grad_state_dict() with keys 'gradients' "
                           f"and 'bucket_order', got keys {sorted(state)[:5]}")
        grads, order = state["gradients"], state["bucket_order"]
        unknown = set(grads) - set(self.names)
        if order is not None:
            unknown |= set(order) - set(self.names)
        if unknown or (order is not None and len(order) != len(self.names)):
            raise KeyError("gradsync: the gradient state does not match this model's parameters "
                           f"(unknown: {sorted(unknown)[:5]}); load it into the model it was saved from")
        if order is not None:
            if self.backward_count:
                raise RuntimeError("gradsync: load_grad_state_dict() must come before the first backward")
            index = {name: i for i, name in enumerate(self.names)}
            if "bucket_caps" in state and self.auto_caps is not None:  # the interrupted run's choice
                self.auto_caps.resume(self, *state["bucket_caps"])
            self.load_plan_order([index[name] for name in order])
        for name, p in zip(self.names, self.params):
            p.grad = grads[name].detach().clone().to(p.device) if name in grads else None
        self.load_main_grad_state(state.get("main_grads", {}))
