"""The bucket store: flat buffers, per-parameter views, copy-in, write-back, re-planning from an order.

``BucketStore`` owns gradient memory and nothing else: it issues no collective and keeps no
iteration state. The reducer calls ``copy_in(i)`` when a gradient is ready in a synced backward
(``copy_in_bucket`` once its bucket is complete), ``keep_local(i)`` in a local one (``local_ready(i)``
per bucket with views), and ``write_back(bucket, result, counts)`` once a bucket's
average is known; ``replan(order, caps)`` lays the buckets out again from an order every rank
agreed on, ``renew()`` in new memory. ``ShardedBucketStore`` (``sharded/store.py``) is the same interface for
ZeRO-2-style shards.
"""
from __future__ import annotations

from typing import Any

import torch

from .bucket import SMALL_SLOT, Bucket, slot
from .checks import Graphs, check_grad, fit, is_view_of
from .config import Caps
from .layout import plan_buckets
from .main_grad import MainGrads
from .._torch import foreach_copy_


class BucketStore:
    """Gradient buckets of full size, one per group of parameters, averaged by an all-reduce."""

    replans = True  # buckets may be laid out again from the observed gradient order
    # copy-in once a bucket is complete (copy_in_bucket); a local backward: nothing per gradient, unless a slot or view is .grad
    copies_per_bucket = property(lambda self: self.main is None)
    keeps_local_per_grad = property(lambda self: self.main is not None)
    # a local .grad not its slot is copied in (local_ready, per bucket); reduce_dtype's slots take it per gradient
    adopts_views = property(lambda self: self.grad_as_view and self.main is None)
    # the window's local gradients survive a reduction (not views of the buckets, nor their slots, or kept apart)
    keeps_local_grads = property(lambda self: self.apart or (not self.grad_as_view and self.main is None))
    apart = False  # keep_window_apart(): every bucket reduces a staged copy of itself
    sharded, exclusive = False, False  # exclusive: only the store's own optimizer may step its parameters (guard.py)

    def __init__(self, params: list[torch.Tensor], names: list[str], *, world_size: int, caps: Caps,
                 reduce_dtype: torch.dtype | None = None, gradient_as_bucket_view: bool = False):
        self.params, self.names, self.world_size = params, names, world_size
        self.caps = caps  # the caps in use: the one owner ("auto" changes them through replan)
        self.reduce_dtype, self.grad_as_view = reduce_dtype, gradient_as_bucket_view
        self.plan_order: list[int] | None = None  # rank 0's observed order, once re-planned
        self.buckets, self.views = [], []  # list[Bucket], each parameter's slot: _build's
        self.view_ptrs: list[int] = []  # each view's data_ptr(): is ``.grad`` the view (is_view_of), read once
        self.lent: set[int] = set()  # .grad made its view by a local backward, where torch's is autograd's tensor
        self.restored_synced: set[int] = set()  # .grad loaded mid-window that a synced backward wrote: not local
        self.bucket_of = [0] * len(params)
        self._build(plan_buckets(params, *caps))
        self.main, self.graphs = None, Graphs()
        if reduce_dtype is not None:
            self.main = MainGrads(params, names, self.slot, world_size=world_size, grad_is_slot=gradient_as_bucket_view)
            self.main.link(self.views, None)

    def _build(self, plan: list[list[int]]) -> None:
        old_views = self.views or None
        self.buckets, self.views = [], [None] * len(self.params)  # type: ignore[list-item]
        for b, members in enumerate(plan):
            first = self.params[members[0]]
            total = sum(self.params[i].numel() for i in members)
            buffer = torch.zeros(total, dtype=self.reduce_dtype or first.dtype, device=first.device)
            views, offset = [], 0
            for i in members:
                p = self.params[i]
                views.append(slot(buffer, offset, p))
                offset += p.numel()
                self.views[i] = views[-1]
                self.bucket_of[i] = b
            large = frozenset(k for k, view in enumerate(views) if view.numel() >= SMALL_SLOT)
            self.buckets.append(Bucket(b, list(members), buffer, views, large=large))
            if self.apart:
                self.buckets[-1].add_wire()
        self.view_ptrs = [v.data_ptr() for v in self.views]
        if old_views is None:
            return
        if self.main is not None:
            self.main.link(self.views, old_views)
        if self.grad_as_view:
            for i, p in enumerate(self.params):
                if is_view_of(p.grad, old_views[i]):
                    self.views[i].copy_(p.grad)
                    p.grad = self.views[i]

    def keep_window_apart(self) -> None:
        """Reduce a copy of each bucket: a window kept in them (views, ``reduce_dtype``) survives a failed reduction."""
        if not self.keeps_local_grads:
            self.apart = True
            for b in self.buckets:
                b.add_wire()

    def slot(self, i: int) -> torch.Tensor:  # parameter ``i``'s place in its bucket
        return self.views[i]

    def plan(self) -> list[list[int]]:
        """The current buckets as lists of parameter indices."""
        return [list(b.members) for b in self.buckets]

    def replan(self, order: list[int], caps: Caps | None = None) -> None:
        """Lay the buckets out from ``order`` (every rank's the same) and ``caps`` (default: the current)."""
        self.plan_order, self.caps = list(order), self.caps if caps is None else caps
        if (plan := plan_buckets(self.params, *self.caps, order)) != self.plan():
            self._build(plan)

    def renew(self) -> None:
        """The same buckets in new memory (the window carried over), so that nothing written into the old one counts."""
        self._build(self.plan())

    def nbytes(self, bucket: Bucket) -> int:
        return bucket.buffer.numel() * bucket.buffer.element_size()

    # ---------------------------------------------------------------- gradients in and out
    def copy_in(self, i: int, divide: bool) -> None:
        """Put parameter ``i``'s window gradient into its slot; ``divide``: average on the way, which
        saves a pass over the bucket (no comm hook: the all-reduce then sums averages). Small slots
        (``SMALL_SLOT``) and slots that already are ``.grad`` are divided together once the bucket's
        last member is in: one division per bucket, the same values."""
        grad, view, divide = self.params[i].grad, self.views[i], divide and not self.apart  # apart: on staging
        if grad is not None and grad.requires_grad:  # backward(create_graph=True): its graph rejoins at write_back
            grad = self.graphs.keep(i, grad, self.params[i])  # (reduce_dtype refused it: main_grad.py)
        if self.main is not None:
            self.main.copy_in(i, divide)
            return
        now = kept = False  # averaged on its way in; already .grad (averaged in place later)
        if grad is None:
            view.zero_()
        elif self.grad_as_view and self._is_slot(i, grad):
            kept = i not in self.lent  # averaged as torch averages its .grad: autograd's own tensor where lent
            self.lent.discard(i)
        else:
            check_grad(grad, view, self.names[i])
            if divide and view.numel() >= SMALL_SLOT:
                torch.mul(grad, 1.0 / self.world_size, out=view)  # torch's reducer scales a copy by 1 / W
                now = True
            else:
                view.copy_(grad)
            if self.grad_as_view:
                self.params[i].grad = view
        if divide:
            self.buckets[self.bucket_of[i]].count_in(view, self.world_size, now, grad is None, kept)

    def copy_in_bucket(self, bucket: Bucket, divide: bool) -> None:
        """``copy_in`` for every member of a complete bucket, the small gradients in one call (a call each: slow)."""
        grads, divide = [self.params[i].grad for i in bucket.members], divide and not self.apart
        for grad, view in zip(grads, bucket.views):  # anything unusual: one member at a time, as copy_in
            if (grad is None or grad.requires_grad or grad.layout is not torch.strided or grad.dtype is not view.dtype
                    or grad.shape != view.shape):
                for i in bucket.members:
                    self.copy_in(i, divide)
                return
        views, members, ptrs = bucket.views, bucket.members, self.view_ptrs
        fresh = ([k for k, i in enumerate(members) if grads[k].data_ptr() != ptrs[i]] if self.grad_as_view
                 else range(len(members)))  # with views, .grad may already be its slot
        large = {k for k in fresh if k in bucket.large} if divide and bucket.large else set()
        for k in large:  # divided on their way in: one pass over their memory
            torch.mul(grads[k], 1.0 / self.world_size, out=views[k])
        small = [k for k in fresh if k not in large] if large else fresh
        if small:
            foreach_copy_([views[k] for k in small], [grads[k] for k in small])
        if self.grad_as_view:
            for k in fresh:
                self.params[members[k]].grad = views[k]
        if divide:
            # with views, a .grad that already was its slot is divided in place, as torch's; one a local backward
            # lent (torch's was autograd's own tensor) is scaled with the copies
            kept = set() if len(fresh) == len(members) else \
                {k for k, i in enumerate(members) if i not in self.lent}.difference(fresh)
            if self.lent:
                self.lent.difference_update(members)
            if not large and not kept:  # bucket.average's first case, here: a file fewer on the trip
                bucket.buffer.mul_(1.0 / self.world_size)
            else:
                scaled = [v for k, v in enumerate(views) if k not in large and k not in kept]
                bucket.average(self.world_size, scaled if scaled or large else None, [views[k] for k in sorted(kept)])

    def keep_local(self, i: int) -> None:
        """Unsynced backward: keep parameter ``i``'s gradient for the next synced one (with views, in its slot)."""
        if self.main is not None:
            self.main.release_grad(i)
            return
        grad = self.params[i].grad
        if self.grad_as_view and grad is not None and not self._is_slot(i, grad):  # replaced by autograd: copy in
            check_grad(grad, self.views[i], self.names[i])
            self.views[i].copy_(grad.detach())
            self.params[i].grad = self.views[i]
            self.lent.add(i)

    def local_ready(self, i: int) -> None:
        """``keep_local`` counted per bucket (the hooks' path with views): a complete bucket adopts its views."""
        bucket, grad = self.buckets[self.bucket_of[i]], self.params[i].grad
        if grad is not None and not self._is_slot(i, grad):
            bucket.fresh.append(i)
        bucket.pending -= 1
        if bucket.pending == 0:
            self.adopt_views([bucket])

    def adopt_views(self, buckets: list[Bucket] | None = None) -> None:
        """``keep_local`` in one copy per bucket, not a call per small gradient: for the members of ``buckets``
        the hooks found fresh, or (default) every member of those a local backward left incomplete."""
        params, ptrs = self.params, self.view_ptrs
        for bucket in [b for b in self.buckets if b.pending] if buckets is None else buckets:
            # the hooks listed a complete bucket's fresh gradients; else _is_slot inline (a call each was most of it)
            fresh = bucket.fresh if buckets is not None else [
                i for i in bucket.members if (g := params[i].grad) is not None
                and (g.layout is not torch.strided or g.data_ptr() != ptrs[i])]
            bucket.fresh = []
            grads, views = [params[i].grad for i in fresh], [self.views[i] for i in fresh]
            if not fit(grads, views):
                for i in fresh:  # one at a time, through check_grad's errors
                    self.keep_local(i)
            elif fresh:
                foreach_copy_(views, grads)
                for i, view in zip(fresh, views):
                    params[i].grad = view
            self.lent.update(fresh)

    def _is_slot(self, i: int, grad: torch.Tensor) -> bool:
        """``is_view_of(grad, self.views[i])``, from the view's data pointer read once at the build."""
        return grad.layout is torch.strided and grad.data_ptr() == self.view_ptrs[i]  # sparse: no data pointer

    @torch.no_grad()  # a create_graph backward runs this with grad mode on: record nothing
    def write_back(self, bucket: Bucket, result: torch.Tensor | None, counts: list[int]) -> None:
        """Make ``.grad`` the bucket's average; a parameter no rank used keeps its ``.grad`` (None stays None)."""
        if result is not bucket.buffer:
            bucket.buffer.copy_(result.reshape(bucket.buffer.shape))
        params, main = self.params, self.main
        if main is not None:
            for i, view in zip(bucket.members, bucket.views):
                main.fresh[i] = True  # the next gradient starts a new window
                if counts[i]:
                    main.write_back(i, view)
        elif self.grad_as_view:
            for i, view in zip(bucket.members, bucket.views):
                if counts[i]:
                    grad = params[i].grad
                    if grad is None or not self._is_slot(i, grad):
                        params[i].grad = view
        else:
            grads, views = [], []  # the copies in one call
            for i, view in zip(bucket.members, bucket.views):
                if counts[i]:
                    grad = params[i].grad
                    if grad is None:
                        params[i].grad = view.clone()
                    else:
                        grads.append(grad)
                        views.append(view)
            if grads:
                foreach_copy_(grads, views)
        if self.graphs:  # backward(create_graph=True)
            self.graphs.rejoin(bucket.members, params, self.world_size)

    def drop_local(self) -> None:
        """Drop every local gradient (``.grad`` and, with ``reduce_dtype``, the window's slots)."""
        for p in self.params:
            p.grad = None
        if self.main is not None:
            self.main.forget_window()

    def has_local_grad(self, i: int) -> bool:
        """Parameter ``i`` holds a gradient of this rank (in ``.grad`` or its window slot)."""
        return (self.params[i].grad is not None and i not in self.restored_synced) or (
            self.main is not None and not self.main.fresh[i])

    def grad_tensors(self) -> list[torch.Tensor]:
        """The tensors holding gradients (``.grad`` and, with ``reduce_dtype``, the buckets), once each."""
        grads = [p.grad for i, p in enumerate(self.params) if p.grad is not None
                 and not (self.main is not None and is_view_of(p.grad, self.views[i]))]
        if self.main is not None:
            grads += [b.buffer for b in self.buckets]
        return grads

    # ---------------------------------------------------------------- the reducer's phases
    def begin_sync(self) -> None:
        """A synced backward starts: every bucket waits for all its members again."""
        self.graphs.clear()  # a backward that raised left its own
        for b in self.buckets:
            b.pending, b.handle, b.copied = len(b.members), None, 0

    def copy_in_all(self, divide: bool) -> None:
        """Copy every gradient into its slot at once (``static_graph``'s first synced backward)."""
        for i in range(len(self.params)):
            self.copy_in(i, divide)
        for b in self.buckets:
            b.pending = 0

    def write_back_as_reduced(self, launcher: Any, everyone: list[int], check: Any, done: Any) -> None:
        """Write each bucket back as soon as it is reduced and call ``done(members)`` (overlap_optimizer; ``everyone``:
        the counts, known before the control: find_unused_parameters is refused there); the control's checks come
        after: a failing one raises on every rank, these buckets already stepped."""
        for b in self.buckets:
            result = launcher.result(b)
            if check is not None:
                check([result], [b.members])
            self.write_back(b, result, everyone)
            done(b.members)

    def begin_backward(self, syncing: bool) -> None:
        """A backward starts: a local one with views counts each bucket's members in again (local_ready)."""
        if self.restored_synced:  # read once, at the first backward after a load (grad_state.py)
            self.restored_synced = set()
        if syncing and self.grad_as_view and list(map(torch.Tensor.data_ptr, self.views)) != self.view_ptrs:
            self.renew()  # `.grad.data = ...` (module.to(memory_format=...)) moved a view (it is .grad): copied back in
        if not syncing and self.adopts_views:
            for b in self.buckets:
                b.pending, b.fresh = len(b.members), []

    def end_sync(self, results: list[Any] | None, counts: list[int], done: Any = None) -> None:
        """The synced backward's checks passed: write every bucket's average back, then ``done(members)``."""
        for bucket, result in zip(self.buckets, results or ()):
            self.write_back(bucket, result, counts)
            if done is not None:  # overlap_optimizer under a commit protocol: a step only after the commit
                done(bucket.members)

    def reset(self) -> None:
        """The last backward raised before its end: drop what it left in flight."""
        for b in self.buckets:
            b.copied, b.divided, b.unscaled, b.undivided = 0, 0, [], []

    def release(self) -> None:
        """The wrapper is gone."""
        if self.main is not None:
            self.main.release()

    def check_foreign_step(self, optimizer: Any) -> None:
        """Only for ``exclusive`` stores: raise for an optimizer that must not step these parameters."""


__all__ = ["Bucket", "BucketStore", "SMALL_SLOT"]
