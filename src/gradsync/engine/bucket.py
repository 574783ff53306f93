"""A bucket: parameters whose gradients share one flat buffer and one collective."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .._torch import foreach_div_, foreach_mul_


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
    # synced backward begins), how many of them were averaged on the way, the slots left to average
    # (copied ones, and ones that already were ``.grad``: ``average``)
    copied: int = 0
    divided: int = 0
    unscaled: list[torch.Tensor] = field(default_factory=list)
    undivided: list[torch.Tensor] = field(default_factory=list)
    times: dict[str, float] = field(default_factory=dict)  # the comm trace's timestamps
    large: frozenset[int] = frozenset()  # positions of members of SMALL_SLOT elements or more
    # BucketStore.keep_window_apart: the collective reduces this copy, so ``buffer`` (the window) survives it
    wire: torch.Tensor | None = None
    wire_views: list[torch.Tensor] = field(default_factory=list)

    def add_wire(self) -> None:
        self.wire = wire = torch.empty_like(self.buffer)
        self.wire_views = [slot(wire, v.storage_offset(), v) for v in self.views]

    def count_in(self, view: torch.Tensor, world_size: int, divided: bool, zero: bool, kept: bool) -> None:
        """Count a member in; once all are, average what was not on the way (zeroed slots need nothing)."""
        if self.copied == 0:  # a new round: forget what an interrupted one left
            self.divided, self.unscaled, self.undivided = 0, [], []
        self.copied += 1
        if divided:
            self.divided += 1
        elif not zero:
            (self.undivided if kept else self.unscaled).append(view)
        if self.copied == len(self.members):
            self.average(world_size, self.unscaled if self.divided else None, self.undivided)
            self.copied, self.divided, self.unscaled, self.undivided = 0, 0, [], []

    def average(self, world_size: int, copied: list[torch.Tensor] | None, kept: list[torch.Tensor]) -> None:
        """Average the slots not averaged on the way in as torch's reducer does, for its bits at any world size: a
        copied gradient times 1 / W, a ``.grad`` that already was its slot divided by W. ``copied`` None: every slot
        not ``kept`` (the whole buffer, where none is)."""
        if copied is None and len(kept) in (0, len(self.views)):  # one pass over the buffer
            self.buffer.mul_(1.0 / world_size) if not kept else self.buffer.div_(world_size)
            return
        if copied is None:
            copied = [v for v in self.views if all(v is not k for k in kept)]
        if copied:
            foreach_mul_(copied, 1.0 / world_size)
        if kept:
            foreach_div_(kept, world_size)


def slot(buffer: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """``like``'s place in flat ``buffer`` from ``offset``, in ``like``'s layout where it is dense (a channels_last
    weight, a transposed parameter), as torch's DDP lays out a bucket view: autograd then accumulates into a
    ``.grad`` of the parameter's own strides, and the optimizer walks gradient and parameter alike."""
    if like.numel() and dense(like):
        return buffer.as_strided(like.shape, like.stride(), buffer.storage_offset() + offset)
    return buffer[offset:offset + like.numel()].view(like.shape)


def dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill a block of memory without gaps or overlaps, in some order of its dimensions."""
    expected = 1
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


# A gradient of fewer elements is copied into its slot and averaged with the bucket's other small slots
# in one call once the bucket is complete (the slot is still in cache then); a larger one is averaged
# on its way in, one pass over its memory. A Python-issued division costs several microseconds of
# overhead however small the tensor: on models of many small parameters that was most of the hook.
SMALL_SLOT = 1 << 14


__all__ = ["Bucket", "SMALL_SLOT", "dense", "slot"]
