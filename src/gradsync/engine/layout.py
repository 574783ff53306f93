"""Bucket layout: which parameters share a bucket (``plan_buckets``), and when the buckets are laid out again.

Planning is pure: no process group, no tensors. Parameters are grouped by (dtype, device) in reverse
registration order, a small first bucket and then ``bucket_cap_mb``. The first synced backward records
the order in which gradients became ready; after it, rank 0's order is broadcast and every rank re-plans
from it, once (with ``find_unused_parameters`` the order changes between iterations: no re-plan).
``bucket_cap_mb="auto"`` (``autocap.py``) then re-plans through ``replan`` while it times its candidates.
Every re-plan goes through the bucket store, which owns the caps in use.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .config import Caps, ReducerConfig
from .control import ControlPlane


MiB = 1024 * 1024


def plan_buckets(
    params: Sequence[torch.Tensor],
    bucket_cap_mb: float | Sequence[float] = 25.0,
    first_bucket_cap_mb: float = 1.0,
    order: Sequence[int] | None = None,
) -> list[list[int]]:
    """Return buckets as lists of indices into ``params``.

    Parameters are walked in ``order`` (default: reverse registration order, the order in which
    backward usually produces gradients), grouped by (dtype, device), and a group's bucket is
    closed once it reaches its cap: ``first_bucket_cap_mb`` for the group's first bucket,
    ``bucket_cap_mb`` after that (torch's assignment: the same buckets, so the same sums' bits). The small
    first bucket lets communication start early in backward. A sequence ``bucket_cap_mb`` (torch's
    ``bucket_cap_mb_list``) gives each of a group's buckets its own cap, the last one repeating;
    ``first_bucket_cap_mb`` still caps the first.
    Buckets are ordered by the position of their first parameter in the walk, so bucket 0 is the
    one expected to be ready first.
    """
    caps = list(bucket_cap_mb) if isinstance(bucket_cap_mb, Sequence) else [bucket_cap_mb]
    if not caps or min(caps) <= 0 or first_bucket_cap_mb <= 0:
        raise ValueError(
            f"bucket caps must be positive, got bucket_cap_mb={bucket_cap_mb}, "
            f"first_bucket_cap_mb={first_bucket_cap_mb}"
        )
    if order is None:
        order = range(len(params) - 1, -1, -1)
    order = list(order)
    if sorted(order) != list(range(len(params))):
        raise ValueError("order must be a permutation of the parameter indices")

    limits = [int(first_bucket_cap_mb * MiB)] + [int(c * MiB) for c in (caps[1:] or caps)]  # in whole bytes, as torch
    open_buckets: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    closed: list[tuple[int, list[int]]] = []  # (position of first member in the walk, members)
    first_pos: dict[tuple[torch.dtype, torch.device], int] = {}
    closed_of: dict[tuple[torch.dtype, torch.device], int] = {}  # buckets each group closed so far

    for pos, i in enumerate(order):
        p = params[i]
        key = (p.dtype, p.device)
        members, size = open_buckets.get(key, ([], 0))
        if not members:
            first_pos[key] = pos
        members.append(i)
        size += p.numel() * p.element_size()
        limit = limits[min(closed_of.get(key, 0), len(limits) - 1)]  # each group its own sequence of caps, as torch
        if size >= limit:
            closed.append((first_pos[key], members))
            closed_of[key], members, size = closed_of.get(key, 0) + 1, [], 0
        open_buckets[key] = (members, size)

    for key, (members, _) in open_buckets.items():
        if members:
            closed.append((first_pos[key], members))
    closed.sort(key=lambda item: item[0])
    return [members for _, members in closed]


class Layout:
    def __init__(self, store: Any, plane: ControlPlane, group: dist.ProcessGroup, config: ReducerConfig):
        self.store, self.plane, self.group, self.config = store, plane, group, config
        self.ready_order: list[int] | None = None  # gradient-ready order of the first synced backward
        self.rebuilt = not store.replans  # the one re-plan from observation happened (or never will)
        self.auto: Any = None  # AutoCaps while bucket_cap_mb="auto" has not chosen

    def order(self) -> list[int]:
        """The order the buckets are planned in: the one every rank agreed on, else plan_buckets' default walk."""
        return self.store.plan_order or list(range(len(self.store.params) - 1, -1, -1))

    def keep_registration_order(self) -> None:
        """Never re-plan from an observed order (its broadcast could complete on some members only)."""
        self.rebuilt, self.ready_order = True, None

    def begin_sync(self) -> None:
        if self.ready_order is None and not self.rebuilt:
            self.ready_order = []

    def note_ready(self, i: int) -> None:
        if self.ready_order is not None:
            self.ready_order.append(i)

    def replan(self, order: list[int], caps: Caps | None = None) -> None:
        """Lay the buckets out from ``order`` (every rank's the same); no re-plan from observation after."""
        self.ready_order, self.rebuilt = None, True
        self.store.replan(order, caps)

    def after_sync(self, record: dict | None, shadowed: bool = False) -> None:
        """After a synced backward (``shadowed``: a joined rank's, without gradients of its own)."""
        if shadowed and not self.rebuilt:  # the active ranks re-plan after their first synced backward
            self.ready_order = self.ready_order or []
        if self.ready_order is not None:
            self._rebuild()
        if self.auto is not None and self.auto.choice is None:
            self.auto.observe(record)

    def _rebuild(self) -> None:
        """Re-plan once from rank 0's observed gradient-ready order."""
        order, self.ready_order, self.rebuilt = self.ready_order, None, True
        if self.config.find_unused_parameters and not self.config.static_graph:
            return  # the order changes from iteration to iteration; keep registration order
        n = len(self.store.params)
        seen = set(order)
        order = list(dict.fromkeys(order)) + [i for i in reversed(range(n)) if i not in seen]
        shared = torch.tensor(order, dtype=torch.int64, device=self.plane.device)
        group = self.plane.group  # a CPU group when the data plane is on a device (plane.py)
        self.plane.wait(dist.broadcast(shared, src=dist.get_global_rank(group, 0), group=group,
                                       async_op=True), "the bucket rebuild")
        self.replan(shared.tolist())


__all__ = ["Layout", "MiB", "plan_buckets"]
