"""ZeRO-2-style sharded gradients: reduce-scatter per bucket into a gradient shard per rank.

``ShardedReducer`` reuses the reducer's state machine (readiness hooks, in-order launches,
end-of-backward control check) and changes only what happens to a bucket. Parameters live in
one flat buffer per bucket, padded so that it splits into ``world_size`` equal shards; rank r
owns shard r. In a synced backward each parameter's gradient is copied into a staging buffer
for its bucket and ``.grad`` is released; a full bucket is reduce-scattered (``sharded_comm.py``:
on CPU an all-to-all summed locally) and its average is added to this rank's shard accumulator
(fp32 or wider). Up to ``max_inflight`` buckets are in flight (and ``staging_budget_bytes``).
Staging buffers are in use only while their bucket is being filled or reduced, and a small pool
keeps a few for the next buckets, so gradient memory is about 1/W of the model plus a few
buckets. Under ``no_sync`` gradients accumulate at full
size in ``.grad`` and are reduce-scattered once, at the next synced backward.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core import guard
from ..core.control import check_grad
from ..core.reducer import Reducer
from ..core.storage import Bucket
from .sharded_clip import _install_clip_redirect, _live, clip_shards
from .sharded_comm import BufferPool, exchanges, fold, start_reduce_scatter



@dataclass
class ShardedBucket(Bucket):
    offsets: list[int] = field(default_factory=list)  # members' offsets in the flat buffers
    numel: int = 0  # padded: a multiple of the world size
    flat_param: torch.Tensor | None = None  # parameters are views of this
    grad_shard: torch.Tensor | None = None  # this rank's averaged gradient, accumulated
    out: torch.Tensor | None = None  # reduce-scatter output while in flight
    shard_zero: bool = True  # grad_shard is all zeros (nothing folded since zero_grad)

    @property
    def shard_numel(self) -> int:
        return self.grad_shard.numel()


class ShardedReducer(Reducer):
    """Reducer whose buckets are reduce-scattered into per-rank gradient shards."""

    wrapper_name = "ShardedDataParallel"
    divide_on_copy = False  # the fold (or, off CPU, the launch) divides
    replans_buckets = False  # parameters live in bucket-shaped buffers laid out at construction

    # Reduce-scatters in flight at once (backward folds the oldest before launching another),
    # and a bound on staging memory (buckets being filled or reduced) that launches respect too:
    # more than one in flight lets gloo's worker threads reduce two buckets at once.
    max_inflight = 2
    staging_budget_bytes: int | None = None  # None: max_inflight alone bounds it
    gathers = None  # ShardedOptimizer(prefetch=True)'s pending parameter all-gathers (sharded_prefetch.py)

    def __init__(self, params, names, process_group, **kwargs):
        if kwargs.get("gradient_as_bucket_view"):
            raise ValueError(
                "gradsync: ShardedDataParallel does not take gradient_as_bucket_view=True: gradients "
                "are copied into short-lived staging buckets and released, so there is no full-size "
                "gradient to view. Leave it False."
            )
        self._inflight: deque[ShardedBucket] = deque()
        self.exchange = exchanges(params[0].device)  # see sharded_comm.py
        self.pool = BufferPool(limit=2 * self.max_inflight + 2)
        self.max_inflight_seen = 0
        super().__init__(params, names, process_group, **kwargs)
        self._rebuilt = True  # parameters live in bucket-shaped buffers: never re-plan the buckets
        self.has_grad = [False] * len(self.params)  # got a gradient (on some rank) since zero_grad
        self.partial = False  # a synced backward failed: the shards may hold part of its sum
        self._partial_before = False
        self.staging_bytes = 0
        self.peak_staging_bytes = 0
        guard.mark_exclusive(self)
        _live.add(self)
        _install_clip_redirect()

    # ---------------------------------------------------------------- layout
    def _build_buckets(self, plan: list[list[int]]) -> None:
        if getattr(self, "buckets", None):
            raise RuntimeError("gradsync: sharded buckets cannot be rebuilt")
        n = len(self.params)
        self.buckets: list[ShardedBucket] = []
        self._views = [None] * n
        self._bucket_of = [0] * n
        self._offset_of = [0] * n
        for b, members in enumerate(plan):
            first = self.params[members[0]]
            total = sum(self.params[i].numel() for i in members)
            padded = -(-total // self.world_size) * self.world_size
            flat = torch.zeros(padded, dtype=first.dtype, device=first.device)
            offsets, offset = [], 0
            for i in members:
                p = self.params[i]
                view = flat[offset:offset + p.numel()].view(p.shape)
                view.copy_(p.detach())
                p.data = view  # the post-step all-gather then writes the parameters in place
                self._bucket_of[i], self._offset_of[i] = b, offset
                offsets.append(offset)
                offset += p.numel()
            acc_dtype = torch.promote_types(torch.promote_types(first.dtype, torch.float32),
                                            self.reduce_dtype or first.dtype)
            grad_shard = torch.zeros(padded // self.world_size, dtype=acc_dtype, device=first.device)
            self.buckets.append(ShardedBucket(b, list(members), None, [], offsets=offsets, numel=padded,
                                              flat_param=flat, grad_shard=grad_shard))
        self._param_ptrs = [p.data_ptr() for p in self.params]
        if self.reduce_dtype is not None:
            self._install_main_hooks()

    def _bucket_nbytes(self, bucket: ShardedBucket) -> int:
        return bucket.numel * bucket.flat_param.element_size()

    def _staged_nbytes(self, bucket: ShardedBucket) -> int:
        return sum(t.numel() * t.element_size() for t in (bucket.buffer, bucket.out) if t is not None)

    def _track(self, delta: int) -> None:
        """Account staging memory (buckets being filled or reduced), for benchmarks and tests."""
        self.staging_bytes += delta
        self.peak_staging_bytes = max(self.peak_staging_bytes, self.staging_bytes)

    def check_params_in_place(self) -> None:
        """Raise if a parameter no longer lives in its bucket's flat buffer."""
        moved = [self.names[i] for i, p in enumerate(self.params) if p.data_ptr() != self._param_ptrs[i]]
        if moved:
            raise RuntimeError(
                f"gradsync: parameter(s) {', '.join(moved[:10])} no longer live in ShardedDataParallel's "
                "flat buffers (the module was moved with .to()/.cuda(), or parameter data was replaced). "
                "Updates would not reach them; move or change the module before wrapping it."
            )

    # ---------------------------------------------------------------- backward
    def _begin_backward(self) -> None:
        if self.gathers is not None:  # the forward waited already, unless it bypassed the wrapper
            self.gathers.wait_all()
        self._inflight.clear()
        self._partial_before = self.partial
        super()._begin_backward()
        if self._syncing:
            self.partial = True  # until this backward's end-of-backward check passes

    def _main_view(self, i: int) -> torch.Tensor:
        """Return parameter ``i``'s slot in its bucket's staging buffer, allocating the buffer."""
        bucket = self.buckets[self._bucket_of[i]]
        if bucket.buffer is None:
            if self.reduce_dtype is None:
                bucket.buffer = self._take(bucket, bucket.numel, bucket.flat_param.dtype)
                end = bucket.offsets[-1] + self.params[bucket.members[-1]].numel()
                bucket.buffer[end:].zero_()  # padding
            else:  # also the window's accumulation buffer
                bucket.buffer = self._take(bucket, bucket.numel, self.reduce_dtype).zero_()
            self._track(self._staged_nbytes(bucket))
        p = self.params[i]
        return bucket.buffer[self._offset_of[i]:self._offset_of[i] + p.numel()].view(p.shape)

    def _take(self, bucket: ShardedBucket, numel: int, dtype: torch.dtype) -> torch.Tensor:
        self.pool.limit = 2 * self.max_inflight + 2  # about the staging peak: in flight, being filled
        return self.pool.take(numel, dtype, bucket.flat_param.device)

    def _copy_to_bucket(self, i: int) -> None:
        if self.reduce_dtype is not None:
            self._copy_main(i)
            return
        p = self.params[i]
        view = self._main_view(i)
        grad = p.grad
        if grad is None:
            view.zero_()
        else:
            check_grad(grad, view, self.names[i])
            view.copy_(grad)
            p.grad = None  # the full-size gradient is not kept: its bucket holds it until reduced

    def _launch(self, bucket: ShardedBucket) -> None:
        if self._iter_trace is not None:
            bucket.times["launch"] = time.perf_counter()
        out_numel = bucket.numel if self.exchange else bucket.shard_numel
        out_bytes = out_numel * bucket.buffer.element_size()
        budget = self.staging_budget_bytes
        while self._inflight and (len(self._inflight) >= max(1, self.max_inflight) or
                                  (budget is not None and self.staging_bytes + out_bytes > budget)):
            self._fold(self._inflight.popleft())  # before allocating this bucket's output
        bucket.out = self._take(bucket, out_numel, bucket.buffer.dtype)
        bucket.handle = start_reduce_scatter(bucket.buffer, bucket.out, self.world_size, self.group, self.exchange)
        self._track(out_bytes)
        self._inflight.append(bucket)
        self.max_inflight_seen = max(self.max_inflight_seen, len(self._inflight))

    def _fold(self, bucket: ShardedBucket) -> None:
        """Wait for ``bucket``'s reduce-scatter, add it to the shard and free the staging buffers."""
        self.wait(bucket.handle, f"bucket {bucket.index}")
        if self._iter_trace is not None:  # gloo's reduce-scatter has no future: time the wait's end
            bucket.times["done"] = time.perf_counter()
        fold(bucket.grad_shard, bucket.out, self.world_size, self.exchange, bucket.shard_zero)
        bucket.shard_zero = False
        self._track(-self._staged_nbytes(bucket))
        self.pool.give(bucket.buffer, bucket.out)
        bucket.buffer = bucket.out = bucket.handle = None

    # ---------------------------------------------------------------- end of backward
    def _wait_bucket(self, bucket: ShardedBucket) -> None:
        while bucket.handle is not None and self._inflight:
            self._fold(self._inflight.popleft())
        return None

    def _write_back(self, bucket: ShardedBucket, result: Any, counts: list[int]) -> None:
        for i in bucket.members:
            self._fresh[i] = True
            if counts[i] > 0:  # unused on every rank: like torch, the optimizer skips it
                self.has_grad[i] = True

    def _finish_sync(self) -> None:
        super()._finish_sync()
        self.partial = self._partial_before  # only zero_grad() clears an earlier failure

    def _reset_iteration(self) -> None:
        super()._reset_iteration()
        self._inflight.clear()
        for b in self.buckets:
            self._track(-self._staged_nbytes(b))
            b.buffer = b.out = b.handle = None

    # ---------------------------------------------------------------- gradient shards
    def shard_range(self, bucket: ShardedBucket) -> tuple[int, int]:
        """Return the [start, end) range of ``bucket``'s flat buffer that this rank owns."""
        size = bucket.shard_numel
        return self.rank * size, (self.rank + 1) * size

    def zero_grad(self, set_to_none: bool = True) -> None:
        for b in self.buckets:
            b.grad_shard.zero_()
            b.shard_zero = True
        if set_to_none:
            self.has_grad = [False] * len(self.params)
        self.partial = False
        if self.reduce_dtype is not None:  # drop the window's local accumulation
            self._fresh = [True] * len(self.params)
            for b in self.buckets:
                self._track(-self._staged_nbytes(b))
                if b.handle is None:  # else a failed backward left it in flight: not reusable
                    self.pool.give(b.buffer)
                b.buffer = None
        for p in self.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    def check_ready_to_step(self) -> None:
        """Raise unless the shards hold a complete, synchronized gradient."""
        if self.partial:
            raise RuntimeError(
                "gradsync: the last synchronizing backward failed part-way, so the gradient shards are "
                "incomplete. Call optimizer.zero_grad() and redo the accumulation window."
            )
        pending = [self.names[i] for i in range(len(self.params)) if self._has_local_grad(i)]
        if pending:
            raise RuntimeError(
                f"gradsync: {len(pending)} parameter(s) (e.g. '{pending[0]}') hold gradients from "
                "micro-steps under no_sync() that were not reduce-scattered yet. Run the window's last "
                "backward with gradient sync enabled before optimizer.step()."
            )
        self.check_params_in_place()

    def check_foreign_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Raise: an optimizer other than ``ShardedOptimizer`` steps these parameters."""
        raise RuntimeError(
            f"gradsync: {type(optimizer).__name__}.step() got parameters of a ShardedDataParallel "
            "model. Their averaged gradients live in per-rank shards (.grad is None after a "
            "synchronizing backward), so a torch optimizer would skip them silently. Use "
            f"gradsync.ShardedOptimizer(model, torch.optim.{type(optimizer).__name__}, ...) instead.")

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the sharded gradient by its global norm (across all ranks); return that norm."""
        return clip_shards(self, max_norm, norm_type, error_if_nonfinite)

    def remove_hooks(self) -> None:
        super().remove_hooks()
        _live.discard(self)


__all__ = ["ShardedBucket", "ShardedReducer"]
