"""A joined rank's part in the active ranks' synced backward (``model.join()``, ``ddp/join.py``).

It issues what they issue, in their order, with zero gradients: the phase header (an empty row), every
bucket's collective, the end-of-backward control, and every bucket's collective once more when the control
says a rank's backward failed part-way (``replay.py``); then counts the synced backward as theirs and
re-plans the buckets as they do.
"""
from __future__ import annotations

import torch

from .. import process
from . import telemetry
from .bucket import slot
from .control import Verdict, empty_control
from .errors import SyncError
from .reducer import Reducer


def shadow_backward(reducer: Reducer) -> None:
    """Take part in the active ranks' synced backward with zero gradients."""
    reducer.plane.exchange_header(0)
    works = zero_buckets(reducer)
    control = empty_control(reducer.world_size, len(reducer.params), reducer.plane.device, reducer.plane.extra_slots())
    control_work = reducer.plane.launch_control(control)
    for b, work in zip(reducer.buckets, works):
        reducer.wait(work, f"bucket {b.index} (shadowed by a joined rank)")
    reducer.wait(control_work, "the end-of-backward check (shadowed by a joined rank)")
    if int(control[-1]) != len(reducer.plane.active_ranks or ()):
        raise SyncError(
            f"gradsync: joined rank {reducer.rank} shadowed a synced backward, but the active ranks "
            "ran a different sequence of collectives (a forward with gradients enabled must be "
            "followed by exactly one backward inside model.join())"
        )
    plane = reducer.plane  # the control as the active ranks read it: which backward failed part-way (replay.py)
    verdict = Verdict(control.cpu(), reducer.rank, reducer.world_size, len(reducer.params), plane.active(),
                      reducer.counters.sync, plane.extra_slots())
    flags = verdict.failed
    telemetry.take_report(reducer, verdict, None)  # the active ranks' report and straggler warning, as theirs
    failed = sorted(flags)
    if 2 in flags.values():  # the active ranks raise too: their window held gradients synced earlier (sync_each_batch)
        raise SyncError(f"gradsync: rank(s) {failed} failed part-way through a synced backward that joined rank "
                        f"{reducer.rank} shadowed, and it cannot be reduced again without them")
    if failed:  # the active ranks reduce every bucket again without the failed ones' windows
        for b, work in zip(reducer.buckets, zero_buckets(reducer)):
            reducer.wait(work, f"bucket {b.index} reduced again (shadowed by a joined rank)")
    process.announce("shadowed_sync", reducer, failed)  # the accumulator's skip records follow, if any
    if reducer.auto_caps is not None and reducer.auto_caps.due:  # as the active ranks, before their commit
        reducer.auto_caps.gather()
    reducer.counters.sync += 1  # it took part in the active ranks' synced backward:
    reducer.layout.after_sync(None, shadowed=True)  # re-plans, and times "auto"'s candidates, as the others do


def zero_buckets(reducer: Reducer) -> list:
    """Issue every bucket's collective with zeros, as the active ranks issue theirs."""
    works: list = []
    launcher, buckets = reducer.launcher, reducer.buckets
    for b in buckets:
        zeros = torch.zeros_like(b.buffer)
        views = [slot(zeros, v.storage_offset(), v) for v in b.views]
        works.append(launcher.issue(b.index, zeros, views, b.members, works[-1] if works else None,
                                    b.index == len(buckets) - 1))
    launcher.before_control(works)
    return works


__all__ = ["shadow_backward", "zero_buckets"]
