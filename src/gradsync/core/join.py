"""Uneven inputs: ``with model.join():`` lets ranks with fewer batches finish an epoch early.

A joined rank cannot tell from its own state whether an active rank's next backward will
synchronize, so inside ``join()`` every forward of an active rank starts with a tiny handshake
all-reduce: each active rank sets its own slot to 1 and adds whether this forward's backward will
sync. A joined rank loops on the same handshake with zeros. From the sum every rank learns who
is active and what follows, and a joined rank shadows exactly those collectives: the buffer
broadcast (from the lowest active rank) and, when the backward syncs, every bucket's collective
with zero gradients plus the end-of-backward check. When a handshake shows no active rank,
everyone leaves, and parameters and buffers are copied from a rank that was active longest.
Gradients divide by the full world size (zeros from joined ranks), like torch's default.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .control import SyncError, empty_control
from .reducer import Reducer


class Join:
    """Context manager returned by ``DistributedDataParallel.join()``."""

    def __init__(self, ddp: Any, enable: bool = True):
        self.ddp = ddp
        self.enable = enable and ddp.world_size > 1
        self.last_active: list[int] = [0]  # ranks active in the latest handshake that had any
        self.expect_sync: bool | None = None

    def __enter__(self) -> "Join":
        if self.enable:
            if self.ddp._join is not None:
                raise RuntimeError("gradsync: model.join() is already active; do not nest it")
            self.ddp._join = self
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.enable:
            return
        try:
            if exc_type is None:
                self._shadow_until_all_joined()
        finally:
            self.ddp._join = None
            self.ddp.reducer.active_ranks = None

    # ------------------------------------------------------------ active rank
    def before_forward(self) -> int:
        """Run the handshake for one forward of this (active) rank; return the buffer source rank."""
        will_sync = self.ddp.require_backward_grad_sync and torch.is_grad_enabled()
        active, syncs, _ = self._handshake(True, will_sync, self.ddp._will_broadcast_buffers())
        self.ddp.reducer.active_ranks = active
        self.expect_sync = syncs if torch.is_grad_enabled() else None
        return active[0]

    def check_backward(self, sync: bool) -> None:
        if self.expect_sync is not None and sync != self.expect_sync:
            raise RuntimeError(
                "gradsync: inside model.join() the no_sync decision must be made before the forward "
                f"(the forward announced sync={self.expect_sync}, the backward has sync={sync}); "
                "wrap the forward in no_sync() too, or set require_backward_grad_sync before it"
            )
        self.expect_sync = None

    # ------------------------------------------------------------ joined rank
    def _shadow_until_all_joined(self) -> None:
        ddp = self.ddp
        while True:
            active, syncs, broadcasts = self._handshake(False, False, False)
            if not active:
                break
            ddp.reducer.active_ranks = active
            buffers = list(ddp.module.buffers())
            if broadcasts and buffers:
                ddp._broadcast(buffers, active[0])
            if syncs:
                shadow_backward(ddp.reducer)
        ddp._broadcast(list(ddp.module.parameters()) + list(ddp.module.buffers()), self.last_active[0])

    def _handshake(self, active: bool, will_sync: bool,
                   broadcasts: bool) -> tuple[list[int], bool, bool]:
        ddp = self.ddp
        w, rank = ddp.world_size, ddp.reducer.rank
        flags = torch.zeros(w + 2, dtype=torch.int64, device=ddp.reducer.device)
        if active:
            flags[rank] = 1
            flags[w] = int(will_sync)
            flags[w + 1] = int(broadcasts)
        ddp.reducer.wait(dist.all_reduce(flags, group=ddp.process_group, async_op=True),
                          "the join handshake")
        values = flags.tolist()
        ranks = [r for r in range(w) if values[r] == 1]
        if any(v not in (0, 1) for v in values[:w]) or (active and rank not in ranks):
            raise SyncError(f"gradsync: rank {rank}'s join handshake paired with a different "
                            "collective on another rank: the ranks ran different sequences of "
                            "collectives inside model.join()")
        if values[w] not in (0, len(ranks)):
            raise SyncError(
                f"gradsync: inside model.join(), ranks disagree about whether this backward "
                f"synchronizes ({values[w]} of {len(ranks)} active ranks will sync): one entered "
                "no_sync() (or disabled gradients) when another did not"
            )
        if values[w + 1] not in (0, len(ranks)):
            raise SyncError(
                f"gradsync: inside model.join(), {values[w + 1]} of {len(ranks)} active ranks broadcast "
                "buffers in this forward: the ranks disagree about train()/eval() mode"
            )
        if ranks:
            self.last_active = ranks
        return ranks, bool(values[w]), bool(values[w + 1])


def shadow_backward(reducer: Reducer) -> None:
    """Take part in the active ranks' synced backward with zero gradients."""
    works: list = []
    for b in reducer.buckets:
        zeros = torch.zeros_like(b.buffer)
        views = [part.view_as(v) for part, v in zip(zeros.split([v.numel() for v in b.views]), b.views)]
        works.append(reducer.issue(b.index, zeros, views, b.members, works[-1] if works else None))
    control = empty_control(reducer.world_size, len(reducer.params), reducer.device)
    control_work = reducer.launch_control(control, works)
    for b, work in zip(reducer.buckets, works):
        reducer.wait(work, f"bucket {b.index} (shadowed by a joined rank)")
    reducer.wait(control_work, "the end-of-backward check (shadowed by a joined rank)")
    if int(control[-1]) != len(reducer.active_ranks or ()):
        raise SyncError(
            f"gradsync: joined rank {reducer.rank} shadowed a synced backward, but the active ranks "
            "ran a different sequence of collectives (a forward with gradients enabled must be "
            "followed by exactly one backward inside model.join())"
        )
    reducer.sync_count += 1
    if not reducer._rebuilt:  # the active ranks re-plan buckets after their first synced backward
        reducer._ready_order = reducer._ready_order or []
        reducer._rebuild_buckets()
