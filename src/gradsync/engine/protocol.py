"""The engine's socket: the errors a synced backward ends with, and the commit protocol a feature attaches.

Without a protocol (the default) a synced backward writes its reduction back as soon as the control
agrees. A feature whose peers may leave mid-reduction (``gradsync.elastic``) attaches a
``CommitProtocol`` with ``Reducer.attach``; then:

- every wait on a collective goes through ``protocol.wait``, so a rank blocked on a peer that stopped
  sending learns of the failure at once, and a failed collective raises ``PeerFailure``;
- a ``PeerFailure`` while the backward launches buckets (or a forward broadcasts buffers) makes the rank
  stop using its group (``lose_group``): the backward goes on locally, the window's ``.grad`` stays whole;
- at the end of backward nothing is written back until ``protocol.commit`` says every member holds the
  reduction; after a failure or a vote that is not unanimous, ``protocol.reform`` returns the survivors'
  group and the reducer reduces the same window again in it (``reduce_until_committed``).

The store keeps the window apart from a reduction in flight (``BucketStore.keep_window_apart``: with
gradient views or ``reduce_dtype``, a staged copy of each bucket is reduced; a sharded store keeps its staging
buckets, and re-shards over a new group in ``regroup``), the launcher keeps a comm hook's state to put back
(``rewind``); a feature refuses what cannot be rolled back (``elastic/attach.py``). A collective after the
commit that fails (``ShardedOptimizer``'s all-gathers) re-forms through ``Attachment.recover``.
"""
from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import torch.distributed as dist

from .control import BACKWARD
from .errors import PeerFailure


class CommitProtocol(Protocol):
    def wait(self, handle: Any, timeout: timedelta) -> None:
        """Wait for a Work or future; raise as soon as the group is known broken, or after ``timeout``."""

    def broken(self, failure: BaseException) -> None:
        """This rank stopped using the group: tell the others (their waits end at once)."""

    def commit(self, sync: int) -> bool:
        """Vote that this rank holds synced backward ``sync``'s reduction; True when every member did."""

    def reform(self, failure: BaseException, sync: int, committed: bool = False) -> dist.ProcessGroup:
        """Abort synced backward ``sync``, agree on the survivors and return their new group (``committed``: it
        committed, a collective after it failed: the window is kept)."""


def attach(reducer: Any, protocol: CommitProtocol, on_regroup: Callable[[dist.ProcessGroup], None]) -> None:
    """Let ``protocol`` decide when ``reducer``'s reductions count and which group reduces next."""
    reducer.attached = Attachment(reducer, protocol, on_regroup)
    reducer.plane.protocol = protocol
    reducer.layout.keep_registration_order()  # its re-plan broadcast could complete on some members only
    reducer.store.keep_window_apart()  # a failed reduction must leave each member's window whole
    reducer.launcher.rewinds = True  # and a comm hook's state as it was (launcher.py)


class Attachment:
    """A commit protocol attached to one reducer, and what it knows of the group (``broken``)."""

    def __init__(self, reducer: Any, protocol: CommitProtocol, on_regroup: Callable[[dist.ProcessGroup], None]):
        self.reducer, self.protocol, self.on_regroup = reducer, protocol, on_regroup
        self.broken: BaseException | None = None  # the failure that made this rank stop using its group

    def lose_group(self, failure: BaseException) -> None:
        """Stop using the group until this window's synced backward re-forms it; tell the others."""
        if isinstance(failure.__cause__, (dist.DistNetworkError, dist.DistStoreError)):  # the store did not answer (the
            raise failure.__cause__  # coordinator): a re-form asks it too, and would wait as long again before ending
        if self.broken is None:
            self.broken = failure
            self.reducer.plane.drop_header()
            self.protocol.broken(failure)

    def reduce_until_committed(self, failed: int) -> tuple:
        """Reduce and vote; after a failure or a vote that is not unanimous, re-form and reduce again."""
        reducer = self.reducer
        while True:
            failure = self.broken
            if failure is None:
                try:
                    reduced = reducer.reduce(failed)
                    if self.protocol.commit(reducer.counters.sync):
                        return reduced
                    failure = PeerFailure(f"gradsync: a member did not finish synced backward {reducer.counters.sync}")
                except PeerFailure as exc:
                    failure = exc
            self.reform(failure)
            self.restart_sync()

    def regroup(self, group: dist.ProcessGroup, joining: bool = False) -> None:
        """Point the reducer's parts at ``group`` (the survivors' new group, or a joiner's first); a sharded store
        re-shards over it, every member at once (``joining``: this rank holds nothing of the model yet)."""
        r = self.reducer
        r.group, r.rank, r.world_size = group, dist.get_rank(group), dist.get_world_size(group)
        r.plane.regroup(group, r.rank, r.world_size)
        r.last_report = None  # the next report comes a synced backward later, on a joiner too (its ranks are new)
        if r.stragglers is not None:
            r.stragglers.forget()
        r.launcher.group = r.layout.group = group
        if r.store.sharded:  # through the control group (on the CPU), every wait bounded
            r.store.regroup(r.plane.group, r.rank, r.world_size, r.plane.wait, contributes=not joining)
        else:
            # new bucket memory: a member frozen in the old group, once continued, can complete the collectives the
            # others left there (gloo cannot cancel them), which write into the memory they were given
            r.store.world_size = r.world_size
            r.store.renew()
        self.on_regroup(group)

    def agree(self, what: str) -> bool:
        """After a collective outside the synced backward (``ShardedOptimizer``'s all-gathers): True once every
        member voted that it finished it, so that no member goes on while another re-forms."""
        return self.protocol.commit(f"{what}/{self.reducer.counters.sync}")

    def recover(self, failure: BaseException) -> None:
        """A collective after the synced backward's commit failed (``ShardedOptimizer``'s all-gathers, a sharded
        clip's all-reduce): re-form and re-shard; the committed window stays."""
        self.reform(failure if isinstance(failure, PeerFailure) else PeerFailure(f"gradsync: {failure}"), committed=True)

    def reform(self, failure: BaseException, committed: bool = False) -> None:
        """Stop using the group, agree on the survivors and point the reducer at their group; a member that dies
        meanwhile (inside a sharded store's re-shard) costs one more round."""
        while True:
            self.lose_group(failure)
            group = self.protocol.reform(failure, self.reducer.counters.sync, committed=committed)
            self.broken = None
            try:
                self.regroup(group)
                return
            except PeerFailure as exc:
                failure = exc

    def restart_sync(self) -> None:
        """Reduce this synced backward again in the new group, from this rank's own window (``.grad``,
        which no failed reduction touched); its header carries the same values."""
        r = self.reducer
        r.it.restart(len(r.params))
        for b in r.store.buckets:
            b.pending, b.handle = len(b.members), None
        r.launcher.rewind()
        r.launcher.reset()
        r.plane.launch_header(BACKWARD)

    def progress(self) -> tuple[int, int, int]:
        """(forwards, backwards, synced backwards): what a replica that joins must match."""
        c = self.reducer.counters
        return c.forward, c.backward, c.sync

    def load_progress(self, progress: tuple[int, int, int]) -> None:
        c = self.reducer.counters
        c.forward, c.backward, c.sync = progress
        self.reducer.pending_forwards = 0

    def layout_state(self) -> dict:
        """The bucket caps in use, ``bucket_cap_mb="auto"``'s progress and the parameters no member used in the last
        synced backward (``skip_all_reduce_unused_params``): a replica that joins lays out, and skips, the same."""
        r, auto = self.reducer, self.reducer.auto_caps
        unused = None if r.skips.unused is None else sorted(r.skips.unused)
        return {"caps": r.store.caps, "auto": auto.state() if auto is not None else None, "unused": unused}

    def load_layout(self, state: dict) -> None:
        r = self.reducer
        r.skips.unused = None if state.get("unused") is None else frozenset(state["unused"])
        if r.auto_caps is not None and state["auto"] is not None:
            r.auto_caps.load_state(state["auto"])
        if r.store.replans:  # a sharded store keeps the layout it was built with, the same on every member
            r.layout.replan(r.layout.order(), tuple(state["caps"]))


def after_commit(reducer: Any, what: str, exchange: Callable[[], Any]) -> Any:
    """Run ``exchange`` (a layer's own collectives after the synced backward's commit, e.g. the accumulator's skip
    records) and return its result. Under a commit protocol every member then votes that it finished them; where a
    member left inside them, the survivors re-form (the committed window is kept) and run them again."""
    while True:
        attached = reducer.attached
        try:
            result = exchange()
            if attached is None or attached.agree(what):
                return result
            failure: BaseException = PeerFailure(f"gradsync: a member did not finish {what}")
        except (RuntimeError, dist.DistError) as exc:  # SyncError and PeerFailure too
            if attached is None:
                raise
            failure = exc
        attached.recover(failure)


__all__ = ["Attachment", "CommitProtocol", "after_commit", "attach"]
