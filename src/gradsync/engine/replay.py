"""A rank that skips a micro-step still runs the collectives the other ranks run in it.

``GradientAccumulator(skip_on=..., skip_nonfinite=...)`` and ``acc.skip()`` end a micro-step on one
rank (``accumulate/skips.py``). gloo pairs the k-th collective of every rank, and every header compares
the ranks' forward and backward counters, so the skipping rank replays what it missed, in order:
the phase header and buffer broadcast of a training forward, and, where the micro-step syncs, a
synced backward that reduces this rank's window so far (``Reducer.sync_without_backward``). Its
counters then equal the others'. A backward that failed part-way without syncing has already added
part of its gradient: the rank drops its local window (every gradient since the last sync), so
nothing partial leaks into the reduction. A backward that failed part-way while syncing has
launched buckets holding partial gradients: the rank sends the rest anyway and flags itself in the
end-of-backward control, and every rank then reduces its local window again, the failed rank
with nothing (``reduce_again_without``: one more round of bucket collectives, only then). That
needs each rank's window apart from its buckets: not with gradient views, ``reduce_dtype``,
sharding or ``overlap_optimizer``, where every rank raises ``SyncError`` instead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .control import SyncError
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


def stand_in(ddp: Any, start: Mark, sync: bool, again: bool = True) -> str:
    """Replay the collectives of a skipped micro-step; return "replayed", "dropped" (a backward failed
    part-way: the local window was dropped) or "resynced" (a synced backward failed part-way: every
    rank reduced again without this rank's window; ``again=False``: this rank's window already holds
    synced gradients (``sync_each_batch``), so that would not be exact and every rank raises)."""
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
            r.fail_sync(again)  # every rank reduces again without this rank's window, or raises
            return "resynced"
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


def reduce_again_without(r: Any, flags: dict[int, int]) -> list[Any]:
    """Every rank: reduce the window again, the ranks in ``flags`` contributing nothing; return the
    buckets' results. Called inside the synced backward's end, in the same order on every rank."""
    store, launcher, failed = r.store, r.launcher, sorted(flags)
    if 2 in flags.values():
        raise SyncError(
            f"gradsync: rank(s) {failed} failed part-way through synced backward {r.sync_count}, after "
            "sending some of their buckets, and their window already held gradients synchronized earlier "
            "in it (sync_each_batch=True), which a reduction without them would lose. No gradient was "
            "written back: call optimizer.zero_grad() and run the window again.")
    if r.bucket_reduced is not None or not store.keeps_local_grads:
        raise SyncError(
            f"gradsync: rank(s) {failed} failed part-way through synced backward {r.sync_count}, after "
            "sending some of their buckets. With gradient_as_bucket_view, reduce_dtype, ShardedDataParallel or "
            "overlap_optimizer a rank's window is not kept apart from its buckets, so it cannot be reduced "
            "again without the failed rank. No gradient was written back: call optimizer.zero_grad() and run "
            "the window again (or skip only failures before the window's last backward).")
    if r.rank in failed:
        store.drop_local()
        r.window_used = [False] * len(r.params)
    for b in store.buckets:
        for i in b.members:
            store.copy_in(i, launcher.divides_on_copy)
    for b in store.buckets:
        launcher.launch(b, store.buckets, False)
    launcher.before_control([b.handle for b in store.buckets])
    return [launcher.result(b) for b in store.buckets]


__all__ = ["Mark", "mark", "reduce_again_without", "stand_in"]
