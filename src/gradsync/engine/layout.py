"""When the buckets are laid out again: once from the observed gradient order, and by ``"auto"``.

The first layout follows registration order. The first synced backward records the order in
which gradients became ready; after it, rank 0's order is broadcast and every rank re-plans from
it, once (with ``find_unused_parameters`` the order changes between iterations: no re-plan).
``bucket_cap_mb="auto"`` (``autocap.py``) then re-plans through ``replan`` while it times its
candidates. Every re-plan goes through the bucket store, which owns the caps in use.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .config import Caps, ReducerConfig
from .plane import ControlPlane


class Layout:
    def __init__(self, store: Any, plane: ControlPlane, group: dist.ProcessGroup, config: ReducerConfig):
        self.store, self.plane, self.group, self.config = store, plane, group, config
        self.ready_order: list[int] | None = None  # gradient-ready order of the first synced backward
        self.rebuilt = not store.replans  # the one re-plan from observation happened (or never will)
        self.auto: Any = None  # AutoCaps while bucket_cap_mb="auto" has not chosen

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


__all__ = ["Layout"]
