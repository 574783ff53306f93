"""The sharded data plane: reduce-scatter each full bucket into this rank's gradient shard.

Plugged into the same reducer as ``engine/launcher.py``'s ``BucketLauncher``. Up to
``max_inflight`` buckets are in flight at once (and ``staging_budget_bytes`` of staging memory):
a launch first folds the oldest bucket in flight (``ShardedBucketStore.fold``) until both bounds
hold. More than one in flight lets gloo's worker threads reduce two buckets at once.
"""
from __future__ import annotations

import time
from collections import deque

import torch.distributed as dist

from ..engine.control import ControlPlane
from .comm import start_reduce_scatter
from .regroup import pass_on
from .store import ShardedBucket, ShardedBucketStore


class ShardedLauncher:
    hook = state = None  # comm hooks return a fully reduced bucket: ShardedDataParallel refuses them
    divides_on_copy = False  # the fold (or, off CPU, the launch) divides
    waited = 0.0  # seconds waited for the phase header (reducer.py times it; BucketLauncher's too)

    def __init__(self, group: dist.ProcessGroup, plane: ControlPlane, store: ShardedBucketStore, *,
                 max_inflight: int = 2, staging_budget_bytes: int | None = None):
        self.group, self.plane, self.store = group, plane, store
        self.max_inflight = max_inflight
        self.staging_budget_bytes = staging_budget_bytes
        self.exchange = store.exchange  # how a bucket is reduce-scattered here (comm.py)
        self.inflight: deque[ShardedBucket] = deque()
        self.max_inflight_seen = 0

    def launch(self, bucket: ShardedBucket, buckets: list[ShardedBucket], traced: bool) -> None:
        if traced:
            bucket.times["launch"] = time.perf_counter()
        store = self.store
        # mirrored (regroup.py): every rank needs two shards of the average; on CPU the all-to-all's fold passes this
        # rank's on to the rank mirroring it (regroup.pass_on), elsewhere the bucket is all-reduced, a copy
        all_reduced = store.mirrored and not self.exchange
        out_numel = bucket.numel if self.exchange or all_reduced else bucket.shard_numel
        out_dtype = bucket.grad_shard.dtype if all_reduced else bucket.buffer.dtype
        out_bytes = out_numel * out_dtype.itemsize
        budget = self.staging_budget_bytes
        while self.inflight and (len(self.inflight) >= max(1, self.max_inflight) or
                                 (budget is not None and store.staging_bytes + out_bytes > budget)):
            self._fold(self.inflight.popleft(), traced)  # before allocating this bucket's output
        bucket.out = store.take(out_numel, out_dtype, bucket.flat_param.device)
        if all_reduced:
            bucket.handle = dist.all_reduce(bucket.out.copy_(bucket.buffer), group=self.group, async_op=True)
        else:
            bucket.handle = start_reduce_scatter(bucket.buffer, bucket.out, store.world_size, self.group, self.exchange,
                                                 keep=store.apart)
        store.track(out_bytes)
        self.inflight.append(bucket)
        self.max_inflight_seen = max(self.max_inflight_seen, len(self.inflight))

    def _fold(self, bucket: ShardedBucket, traced: bool) -> None:
        self.plane.wait(bucket.handle, f"bucket {bucket.index}")
        if traced:  # gloo's reduce-scatter has no future: time the wait's end
            bucket.times["done"] = time.perf_counter()
        if self.store.mirrored and self.exchange:
            try:  # folded once the mirrored shard is in (result)
                bucket.shift = pass_on(self.store, bucket, self.group)
            except (RuntimeError, dist.DistError) as exc:  # a send to a peer that is gone fails as it starts
                raise self.plane.failure(
                    f"gradsync: rank {self.store.rank} could not start passing bucket {bucket.index}'s shard of the "
                    f"average to the rank that mirrors it: {exc}. Likely cause: that rank died.") from exc
        else:
            self.store.fold(bucket)

    def before_control(self, handles: list) -> None:
        """A reduce-scatter is one collective: the control may follow at once."""

    def result(self, bucket: ShardedBucket) -> None:
        """Fold every bucket in flight up to ``bucket`` (mirrored: every one, so that the later passes start before
        this bucket's is waited); the average is in the shard (no tensor)."""
        # until this bucket is folded; mirrored, on until every later bucket's pass started before this one's is waited
        while (bucket.handle is not None or bucket.shift is not None) and self.inflight:
            self._fold(self.inflight.popleft(), bool(bucket.times))
        if bucket.shift is not None:
            for work in bucket.shift:
                self.plane.wait(work, f"bucket {bucket.index}'s mirrored shard")
            bucket.shift = None
            self.store.fold(bucket)
        return None

    def reset(self) -> None:
        self.inflight.clear()

    def rewind(self) -> None:
        """No comm hook here: no state to put back before a second reduction."""


__all__ = ["ShardedLauncher"]
