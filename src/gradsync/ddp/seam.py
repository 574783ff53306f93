"""What the layers (accumulator, sharded optimizer, overlapped optimizer) may ask of a gradsync model.

The layers reach the core through these names only (tests/test_layout.py forbids them another
module's underscore names). A model that is not a ``SyncTarget`` (torch's own DDP, or a plain
module on one process) still works with the accumulator through torch's public attributes.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch.distributed as dist


@runtime_checkable
class SyncTarget(Protocol):
    """A gradsync wrapper, as the layers see it."""

    require_backward_grad_sync: bool  # read when a backward runs: False accumulates locally
    process_group: dist.ProcessGroup
    world_size: int

    def scale_grads_(self, factor: float) -> None:
        """Multiply every synchronized (and pending local) gradient by ``factor``."""

    def wait(self, handle: Any, what: str) -> None:
        """Wait for a collective's Work or future, bounded by the model's timeout."""

    def carry_with_next_sync(self, values: Sequence[float]) -> Callable[[], dict[int, tuple]] | None:
        """Send ``values`` (a few floats) with the next synced backward's phase header, at no extra
        collective; return a reader of the active ranks' values by rank (None until that backward's
        header completed), or None if they cannot be carried (the caller exchanges them itself)."""


    def control_group(self) -> tuple[dist.ProcessGroup, Any]:
        """The group and device for a layer's own small exchanges: the control plane's, a CPU group
        when the gradients are on a device, so that nothing is read back from it."""

    def mark_micro_step(self) -> Any:
        """This rank's counters as a micro-step begins."""

    def stand_in(self, start: Any, sync: bool, again: bool = True) -> str:
        """After a micro-step this rank skipped, run the collectives the other ranks ran in it
        (``engine/replay.py``); return "replayed", "dropped" or "resynced" (local window dropped)."""


    def measure_local_norms(self) -> Callable[[], dict[int, float] | None]:
        """Carry every rank's local squared gradient norm in each synced backward's control; return a
        reader of the latest synced backward's, by rank."""

    def advance_counters(self, micro_steps: int) -> None:
        """Count ``micro_steps`` this rank does not run in a window where others run more (uneven plans)."""

    def keep_window_apart(self) -> None:
        """Keep this rank's window apart from the buckets in flight (skip_on: a synced backward that fails
        part-way is reduced again without the failed rank's window)."""

    def failed_ranks(self) -> list[int]:
        """Ranks whose latest synced backward failed part-way and were reduced as contributing nothing."""

    def after_commit(self, what: str, exchange: Callable[[], Any]) -> Any:
        """Run ``exchange()`` (the layer's own collectives, named ``what``) after the synced backward's commit; where
        members may leave (``gradsync.elastic``) and one does inside it, the survivors re-form and run it again."""


@runtime_checkable
class ReducerView(Protocol):
    """What the layers read of ``model.reducer``: parameters, buckets and the bucket hook."""

    params: list
    names: list
    is_sharded: bool
    index_of: dict[int, int]  # id(parameter) -> its index in ``params``
    config: Any  # engine/config.py's ReducerConfig: what the model was built with
    bucket_reduced: Callable[[list[int]], None] | None  # set by on_bucket_reduced

    def on_bucket_reduced(self, callback: Callable[[list[int]], None] | None) -> None:
        """Call ``callback(members)`` as each bucket is reduced and written back (None: stop)."""


__all__ = ["ReducerView", "SyncTarget"]
