"""A bucket: parameters whose gradients share one flat buffer and one collective."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Bucket:
    index: int
    members: list[int]  # parameter indices
    buffer: torch.Tensor | None
    views: list[torch.Tensor]  # per-member views of ``buffer``, shaped like the parameters
    pending: int = 0  # members not ready yet in this synced backward
    fresh: list[int] = field(default_factory=list)  # a local backward with views: members whose .grad is not their view
    handle: Any = None  # dist.Work (default path) or torch.futures.Future (hook path)
    # ``copy_in`` with ``divide``: members copied in since the round began (the reducer zeroes it as a
    # synced backward begins), how many of them were divided on the way, the slots left to divide
    copied: int = 0
    divided: int = 0
    undivided: list[torch.Tensor] = field(default_factory=list)
    times: dict[str, float] = field(default_factory=dict)  # the comm trace's timestamps
    large: frozenset[int] = frozenset()  # positions of members of SMALL_SLOT elements or more
    # BucketStore.keep_window_apart: the collective reduces this copy, so ``buffer`` (the window) survives it
    wire: torch.Tensor | None = None
    wire_views: list[torch.Tensor] = field(default_factory=list)

    def add_wire(self) -> None:
        self.wire = wire = torch.empty_like(self.buffer)
        self.wire_views = [wire[v.storage_offset():v.storage_offset() + v.numel()].view(v.shape) for v in self.views]


# A gradient of fewer elements is copied into its slot and divided with the bucket's other small slots
# in one call once the bucket is complete (the slot is still in cache then); a larger one is divided
# on its way in, one pass over its memory. A Python-issued division costs several microseconds of
# overhead however small the tensor: on models of many small parameters that was most of the hook.
SMALL_SLOT = 1 << 14


__all__ = ["Bucket", "SMALL_SLOT"]
