"""The seam between the reducer and elastic membership: what a synced backward asks when members may leave.

Without a membership (the default) nothing here runs. With one (``elastic/membership.py`` installs it
for models built on its process group), a synced backward does not write gradients back until
every member has voted that it holds the whole reduction (``commit``); a collective that fails
(``PeerFailure``) or a vote that is not unanimous makes the survivors ``reform`` a new group and
reduce their own windows again in it. Every wait on a collective goes through ``wait``, so that a
member blocked on a peer that stopped sending learns of the failure at once.
"""
from __future__ import annotations

import weakref
from datetime import timedelta
from typing import Any, Protocol

import torch.distributed as dist

from ..ddp import guard
from .control import SyncError
from .header import BACKWARD


class PeerFailure(SyncError):
    """A collective failed or did not finish: a member may have died, or stopped using the group."""


class Membership(Protocol):
    generation: int

    def wait(self, handle: Any, timeout: timedelta) -> None:
        """Wait for a Work or future; raise as soon as the group is known broken, or after ``timeout``."""

    def broken(self, failure: BaseException) -> None:
        """This member stopped using the group: tell the others (their waits end at once)."""

    def commit(self, sync: int) -> bool:
        """Vote that this member holds synced backward ``sync``'s reduction; True when every member did."""

    def reform(self, failure: BaseException, sync: int, window: tuple[int, int] | None) -> dist.ProcessGroup:
        """Abort synced backward ``sync``, agree on the survivors and return their new default group.
        ``window``: (window index, micro-steps it plans per member) when an accumulator drives the model."""


_current: Membership | None = None


def install(membership: Membership | None) -> None:
    """Models built on the default process group from now on follow ``membership`` (None: stop)."""
    global _current
    _current = membership


def current() -> Membership | None:
    return _current




def refusals(config: Any, *, delayed: bool) -> list[str]:
    """What elastic membership cannot recover exactly with this configuration."""
    found = [
        ("gradient_as_bucket_view=True", config.gradient_as_bucket_view),  # .grad is the bucket a failure half-reduced
        ("reduce_dtype", config.reduce_dtype is not None),  # the window lives in the buckets
        ("ShardedDataParallel", config.sharded),
        ("static_graph=True", config.static_graph),
        ('bucket_cap_mb="auto"', config.auto_bucket_cap),  # its choice is broadcast after a synced backward
        ("delay_all_reduce_named_params", delayed),
    ]
    return [name for name, present in found if present]


def follow(ddp: Any, membership: Membership) -> None:
    """Make ``ddp`` (a gradsync wrapper on the default group) follow ``membership``'s generations."""
    problems = refusals(ddp.reducer.config, delayed=ddp._delayed is not None)
    if problems:
        raise ValueError(
            f"gradsync: elastic membership cannot recover a model built with {', '.join(problems)}: a "
            "member's window must stay apart from the buckets a failed reduction touched. Build the model "
            "without it, or pass process_group= explicitly to opt out of elastic membership.")
    r = ddp.reducer
    r.membership = r.plane.membership = membership
    # the one re-plan from the observed order ends in a broadcast after a synced backward, which a
    # failure could complete on some members only: elastic models keep registration order
    r.layout.rebuilt, r.layout.ready_order = True, None
    ref = weakref.ref(ddp)

    def on_regroup(group: dist.ProcessGroup) -> None:
        wrapper = ref()
        if wrapper is not None:
            wrapper.process_group, wrapper.world_size = group, dist.get_world_size(group)
    r.on_regroup = on_regroup


# ---------------------------------------------------------------- the reducer's elastic transitions
def finish_sync(reducer: Any, failed: int) -> tuple:
    """Reduce and vote; after a failure or a vote that is not unanimous, re-form and reduce again.
    Return what ``Reducer._complete`` writes back."""
    while True:
        failure = reducer.broken
        if failure is None:
            try:
                reduced = reducer._reduce(failed)
                if reducer.membership.commit(reducer.counters.sync):
                    return reduced
                failure = PeerFailure(f"gradsync: a member did not finish synced backward {reducer.counters.sync}")
            except PeerFailure as exc:
                failure = exc
        restart_sync(reducer, failure)


def restart_sync(reducer: Any, failure: BaseException) -> None:
    """Agree on the survivors, take their new group, and start this synced backward again in it
    from this rank's own window (``.grad``, which no failed reduction touched)."""
    reducer.break_group(failure)
    window = reducer.window_source() if reducer.window_source is not None else None
    reducer.regroup(reducer.membership.reform(failure, reducer.counters.sync, window))
    reducer.broken = None
    it, n = reducer.it, len(reducer.params)
    it.norm2 = None  # measured again as the buckets launch again
    if it.hooked is None:  # the group broke before this backward's end: its hooks so far are all it had
        it.hooked = list(it.ready)
    it.ready, it.hook_counts, it.next_launch = [False] * n, [0] * n, 0
    for b in reducer.store.buckets:
        b.pending, b.handle = len(b.members), None
    reducer.launcher.reset()
    reducer.plane.launch_header(BACKWARD)  # carries the same values as the failed one


def regroup(reducer: Any, group: dist.ProcessGroup) -> None:
    """Point the reducer's parts (and, through ``on_regroup``, its wrapper) at ``group``."""
    reducer.group, reducer.rank, reducer.world_size = group, dist.get_rank(group), dist.get_world_size(group)
    reducer.plane.regroup(group, reducer.rank, reducer.world_size)
    reducer.launcher.group = reducer.layout.group = group
    reducer.store.world_size = reducer.world_size
    if reducer.world_size > 1:
        guard.install(reducer)  # a replica that joined was built on a group of its own
    if reducer.on_regroup is not None:
        reducer.on_regroup(group)


__all__ = ["Membership", "PeerFailure", "current", "finish_sync", "follow", "install", "refusals", "regroup",
           "restart_sync"]
