"""A rank that skips a micro-step still runs the collectives the other ranks run in it.

``GradientAccumulator(skip_on=..., skip_nonfinite=...)`` and ``acc.skip()`` end a micro-step on one
rank (``layers/skips.py``). gloo pairs the k-th collective of every rank, and every header compares
the ranks' forward and backward counters, so the skipping rank replays what it missed, in order:
the phase header and buffer broadcast of a training forward, and, where the micro-step syncs, a
synced backward that reduces this rank's window so far (``Reducer.sync_without_backward``). Its
counters then equal the others'. A backward that failed part-way without syncing has already added
part of its gradient: the rank drops its local window (every gradient since the last sync), so
nothing partial leaks into the reduction. A backward that failed part-way while syncing has
launched buckets holding partial gradients: that cannot be undone without an extra collective,
so it is not skipped (``stand_in`` reports it and the error is raised).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .header import FORWARD


@dataclass(frozen=True)
class Mark:
    """A rank's counters when a micro-step began."""

    forward: int
    backward: int
    pending: int
    headers: int


def mark(ddp: Any) -> Mark:
    r = ddp.reducer
    return Mark(r.counters.forward, r.counters.backward, r.pending_forwards, r.plane.headers_sent)


def stand_in(ddp: Any, start: Mark, sync: bool) -> str:
    """Replay the collectives of a skipped micro-step; return "replayed", "dropped" (the local window
    was dropped: a backward failed part-way) or "failed" (a synced backward failed part-way)."""
    r = ddp.reducer
    if ddp.join_active:
        raise NotImplementedError("gradsync: skipping a micro-step inside model.join() is not supported: "
                                  "the join handshake already lets a rank run out of data; skip outside it")
    if r.config.static_graph:
        raise NotImplementedError("gradsync: skipping a micro-step with static_graph=True is not supported: "
                                  "the graph would change. Construct the model with static_graph=False")
    c = r.counters
    if r.it.in_backward:  # the backward began: some gradients of this micro-step may be in .grad
        if r.it.syncing:
            return "failed"
        r.drop_window()
        return "dropped"
    if (c.forward == start.forward and r.plane.headers_sent == start.headers and ddp.will_broadcast_buffers()
            and next(ddp.module.buffers(), None) is not None):
        r.plane.exchange_header(FORWARD)  # the forward (or its broadcast) did not run here
        ddp.broadcast_buffers_from(0)
    if c.forward == start.forward:
        c.forward += int(ddp.module.training)  # as the others' training forward counted
    r.pending_forwards = min(r.pending_forwards, start.pending)  # a forward without its backward
    if c.backward == start.backward:
        c.backward += 1
    if sync:
        r.sync_without_backward()
    return "replayed"


__all__ = ["Mark", "mark", "stand_in"]
