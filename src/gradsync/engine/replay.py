"""A rank that skips a micro-step still runs the collectives the other ranks run in it.

``GradientAccumulator(skip_on=..., skip_nonfinite=...)`` and ``acc.skip()`` end a micro-step on one
rank (``accumulate/skips.py``). gloo pairs the k-th collective of every rank, and every header compares
the ranks' forward and backward counters, so the skipping rank replays what it missed, in order:
the phase header and buffer broadcast of a training forward, and, where the micro-step syncs, a
synced backward that reduces this rank's window so far (``sync_without_backward``). Its
counters then equal the others'. A backward that failed part-way without syncing has already added
part of its gradient: the rank drops its local window (every gradient since the last sync), so
nothing partial leaks into the reduction. A backward that failed part-way while syncing has
launched buckets holding partial gradients: the rank sends the rest anyway and flags itself in the
end-of-backward control, and every rank then reduces its local window again, the failed rank
with nothing (``reduce_again_without``: one more round of bucket collectives, only then). That
needs each rank's window apart from its buckets: with gradient views or ``reduce_dtype`` the buckets
reduce staged copies once the accumulator has ``skip_on`` (``keep_window_apart``), ``overlap_optimizer``
steps only after the control, and a sharded store keeps its staging buckets until then (``refill``). With ``static_graph``, a
synced backward this rank skipped or failed does not teach it the graph (``unlearned``). Inside
``model.join()`` a micro-step skipped before its forward runs the join handshake too, and the joined ranks
shadow whatever follows (``shadow.py``).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .._torch import join_enabled
from .control import FORWARD
from .errors import SyncError
from .iteration import IterationState


@dataclass(frozen=True)
class Mark:
    """A rank's counters when a micro-step began."""

    forward: int
    backward: int
    pending: int
    headers: int
    handshakes: int  # inside model.join(): the join handshakes this rank ran as an active rank


def mark(ddp: Any) -> Mark:
    r = ddp.reducer
    return Mark(r.counters.forward, r.counters.backward, r.counters.pending, r.plane.headers_sent,
                getattr(ddp.join_state, "handshakes", 0))


def stand_in(ddp: Any, start: Mark, sync: bool, again: bool = True) -> str:
    """Replay the collectives of a skipped micro-step; return "replayed", "dropped" (a backward failed
    part-way: the local window was dropped) or "resynced" (a synced backward failed part-way: every
    rank reduced again without this rank's window; ``again=False``: this rank's window already holds
    synced gradients (``sync_each_batch``), so that would not be exact and every rank raises)."""
    r = ddp.reducer
    c = r.counters
    delayed = getattr(ddp, "delayed", None)  # delay_all_reduce_named_params: replayed and dropped with the buckets
    if r.it.in_backward:  # the backward began: some gradients of this micro-step may be in .grad
        if r.it.syncing:
            with unlearned(r):
                r.finish_grad_sync(failed=1 if again else 2)  # every rank reduces again without this window, or raises
            if delayed is not None:  # then the others' delayed all-reduce, with nothing from this rank
                delayed.drop_local()
                delayed.reduce_now(ddp)
            return "resynced"
        drop_window(r)
        if delayed is not None:
            delayed.drop_local()
        return "dropped"
    join = ddp.join_state if ddp.join_state is not None and join_enabled(ddp) else None
    if join is not None and join.handshakes == start.handshakes:  # skipped before the forward reached it
        join.before_forward()
    if (c.forward == start.forward and r.plane.headers_sent == start.headers and ddp.will_broadcast_buffers()
            and next(ddp.module.buffers(), None) is not None):
        r.plane.exchange_header(FORWARD)  # the forward (or its broadcast) did not run here
        ddp.broadcast_tensors(list(ddp.module.buffers()), (r.plane.active_ranks or [0])[-1])  # join(): highest active
    if c.forward == start.forward:
        c.forward += int(ddp.module.training)  # as the others' training forward counted
    c.pending = min(c.pending, start.pending)  # a forward without its backward
    if c.backward == start.backward:
        c.backward += 1
    if sync:
        with unlearned(r):
            sync_without_backward(r)
        if delayed is not None:  # as the others' backward ends: the delayed all-reduce
            delayed.reduce_now(ddp)
    return "replayed"


@contextlib.contextmanager
def unlearned(r: Any) -> Iterator[None]:
    """static_graph learns how often each hook fires from the first synced backward: not from one this rank
    skipped or that failed part-way here (its counts would be wrong); the next synced backward teaches it."""
    learning = r.config.static_graph and r.expected.static_counts is None
    try:
        yield
    finally:
        if learning:
            r.expected.static_counts = None


def advance(ddp: Any, micro_steps: int) -> None:
    """Count ``micro_steps`` this rank does not run in a window where the others run more."""
    if ddp.will_broadcast_buffers() and next(ddp.module.buffers(), None) is not None:
        raise ValueError("gradsync: ranks with different numbers of micro-steps in a window cannot broadcast "
                         "buffers at every forward (each forward would pair with a different collective); "
                         "construct the model with broadcast_buffers=False, or give every rank the same count")
    c = ddp.reducer.counters
    c.forward, c.backward = c.forward + micro_steps * int(ddp.module.training), c.backward + micro_steps


def keep_window_apart(r: Any) -> None:
    """The window outlives a synced backward that fails part-way (``skip_on``): the buckets reduce staged copies
    where they hold it (views, ``reduce_dtype``), and overlap_optimizer steps each bucket only after the control,
    once no rank failed (``reduce_again_without`` otherwise)."""
    r.store.keep_window_apart()
    r.window_apart = r.launcher.rewinds = True  # a comm hook's state is put back too (launcher.py)


def drop_window(r: Any) -> None:
    """Forget this rank's local gradients since the last synced backward (a failed backward's partial
    gradients among them): the next synced backward reduces nothing of them."""
    r.reset_iteration()
    r.store.drop_local()
    r.window_used = [False] * len(r.params)


def sync_without_backward(r: Any) -> None:
    """Take part in the others' synced backward with this rank's window so far, as if its own backward
    produced no new gradient."""
    r.it = it = IterationState(in_backward=True)
    unused = set(r.start_sync(it))
    for i in range(len(r.params)):
        r.register_grad_ready(i, from_hook=i not in unused)
    r.finish_grad_sync()


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
    if (r.bucket_reduced is not None and not r.window_apart) or not store.keeps_local_grads:
        raise SyncError(
            f"gradsync: rank(s) {failed} failed part-way through synced backward {r.sync_count}, after "
            "sending some of their buckets. This rank's window is not kept apart from its buckets (an accumulator "
            "with skip_on keeps it), so it cannot be reduced again without the failed rank. No gradient "
            "was written back: call optimizer.zero_grad() and run the window again (or skip only failures before "
            "the window's last backward).")
    if r.rank in failed:
        r.window_used = [False] * len(r.params)
    if store.sharded:  # a sharded store keeps the window in its staging buckets
        store.refill(r.rank in failed)
    else:
        if r.rank in failed:
            store.drop_local()
        for b in store.buckets:
            for i in b.members:
                store.copy_in(i, launcher.divides_on_copy)
    launcher.rewind()  # a comm hook's state as the first reduction found it
    for b in store.buckets:
        launcher.launch(b, store.buckets, False)
    launcher.before_control([b.handle for b in store.buckets])
    return [launcher.result(b) for b in store.buckets]


__all__ = ["Mark", "advance", "drop_window", "mark", "reduce_again_without", "stand_in", "sync_without_backward"]
