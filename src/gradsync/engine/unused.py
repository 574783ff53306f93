"""``skip_all_reduce_unused_params=True``: no collective for a bucket whose parameters no rank uses.

torch 2.13's reducer skips a bucket when every parameter in it is in *this rank's* unused set (found
by walking the forward's graph), and documents that the unused set must be the same on every rank for
the whole training, or the ranks issue different collectives and hang. gradsync decides from what
every rank already agrees on: the end-of-backward control of the previous synced backward, which
carries each parameter's use count over all ranks. A bucket is skipped when each of its parameters
was used by no rank there, so every rank skips the same buckets, in the same order, whatever its own
forward did. The control of this backward then says whether that still held: a skipped bucket whose
parameter did get a gradient on some rank (the graph changed, or ``no_sync`` micro-steps used it) is
reduced after the control, on every rank alike (a warning says so once), so the gradients are always
the ones without the flag; torch would desynchronize there.

Compared with torch: the first synced backward (and the first after ``model.join()`` begins) reduces
every bucket, as nothing is known yet; from the second on the same buckets are skipped as in torch
whenever torch's contract holds. A skipped bucket's parameters keep their ``.grad`` untouched (None
stays None), as in torch. ``_get_ddp_logging_data()["num_buckets_reduced"]`` counts the buckets the
latest synced backward reduced, as torch's does. Skipping is off inside ``model.join()`` (a joined
rank shadows every bucket) and with ``overlap_optimizer`` (buckets are written back before the control).
Under ``gradsync.elastic`` the survivors of a failure reduce the window again with the same plan, and a
replica that joins takes the members' unused set with their state (``Attachment.layout_state``).
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any


class UnusedBuckets:
    """Which buckets a synced backward launches no collective for; the same on every rank."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.unused: frozenset[int] | None = None  # parameters no rank used in the previous synced backward
        self.skipped: frozenset[int] = frozenset()  # bucket indices this synced backward does not launch
        self.reduced: int | None = None  # buckets the latest synced backward reduced (torch's num_buckets_reduced)
        self._warned = False

    def plan(self, buckets: Sequence[Any], allowed: bool) -> None:
        """At the start of a synced backward: choose the buckets to skip (``allowed`` is the same on
        every rank: False inside ``model.join()`` or with ``overlap_optimizer``)."""
        if not allowed:
            self.unused = None  # learned again after: a joined rank did not follow this backward
        unused = self.unused if self.enabled else None
        self.skipped = frozenset() if not unused else frozenset(
            b.index for b in buckets if b.members and all(i in unused for i in b.members))

    def results(self, launcher: Any, buckets: Sequence[Any]) -> list[Any]:
        """Every bucket's reduced tensor; a skipped one's own buffer (no rank put a gradient in it)."""
        return [b.buffer if b.handle is None and b.index in self.skipped else launcher.result(b) for b in buckets]

    def after_control(self, reducer: Any, counts: Sequence[int], results: list[Any] | None,
                      allowed: bool) -> list[Any] | None:
        """Reduce, on every rank alike, the skipped buckets a rank did put a gradient in (``counts``
        is the same everywhere); learn the unused parameters for the next synced backward."""
        buckets = reducer.store.buckets
        late = [b for b in buckets if b.index in self.skipped and b.handle is None
                and any(counts[i] for i in b.members)]
        if late and not self._warned:
            self._warned = True
            names = [reducer.names[i] for b in late for i in b.members if counts[i]]
            warnings.warn(
                f"gradsync: skip_all_reduce_unused_params=True: parameter(s) {', '.join(names[:5])} were used "
                "by no rank in the previous synced backward, so their bucket was not launched with the others, "
                "but got a gradient in this one. Their bucket was reduced after the others, on every rank "
                "(correct, with less overlap). torch's DDP needs the set of unused parameters to stay the "
                "same on every rank for the whole training; if it changes, drop the flag.", stacklevel=2)
        for b in late:
            reducer.launcher.launch(b, buckets, reducer.it.record is not None)
            if results is not None:
                results[b.index] = reducer.launcher.result(b)
                if reducer.plane.replicas is not None:  # check_replicas took its unreduced buffer: now the result
                    reducer.plane.replicas.reduced_late(b.index)
        self.unused = frozenset(i for i, c in enumerate(counts) if c == 0) if allowed and self.enabled else None
        self.skipped = frozenset()
        return results

    def forget(self) -> None:
        """Learn the unused parameters from scratch (every rank calls this at the same point)."""
        self.unused, self.skipped = None, frozenset()


__all__ = ["UnusedBuckets"]
