"""Each bucket reduced in one fixed order: all-to-all, the parts summed in rank order, all-gather.

A ring or tree all-reduce adds the ranks' buckets in an order its algorithm picks, which changes with
the world size. Here the bucket is cut into W chunks; an all-to-all gives rank c every rank's chunk c,
which it sums in rank order (``TreeSum``: the top of the window's tree); an all-gather returns every
summed chunk to every rank, in place. Each rank sends and receives (W - 1)/W of the bucket twice: the bytes
of a ring all-reduce. A bucket's all-to-all starts when it is full; its sum and all-gather start when the
next bucket launches (the all-to-all has had that bucket's backward to arrive), the last bucket's when
its result is taken: the same sequence of collectives on every rank. Two ranks need none of it: a sum
of two values has one order, so their buckets take the default all-reduce.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..engine.collectives import all_gather
from ..engine.launcher import BucketLauncher
from ..engine.store import Bucket
from .tree import TreeSum


class OrderedLauncher(BucketLauncher):
    """``BucketLauncher`` whose every bucket is reduced in rank order; comm hooks are refused."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.exchanged: dict[int, tuple] = {}  # bucket -> (all-to-all, its output, what it sent, numel)
        self.gathering: dict[int, tuple[Any, torch.Tensor, int]] = {}  # bucket -> (all-gather, its output, numel)

    def set_hook(self, hook: Any, state: Any) -> None:
        if hook is not None:
            raise ValueError("gradsync: deterministic=True reduces every bucket in one fixed order of its own; a "
                             "communication hook would reduce it another way. Register no hook, or pass "
                             "deterministic=False")

    def issue(self, index: int, buffer: torch.Tensor, views: list[torch.Tensor], members: list[int],
              previous: Any, is_last: bool) -> Any:
        world = self.group.size()
        if world <= 2:  # a + b is b + a: any all-reduce of two ranks adds in the one order there is
            return dist.all_reduce(buffer, group=self.group, async_op=True)
        if index - 1 in self.exchanged:  # the previous bucket's second half, before this one's first
            self.gather(index - 1)
        numel, out = buffer.numel(), buffer  # a bucket that splits evenly is sent and gathered in place
        if numel % world:
            out = torch.zeros(-(-numel // world) * world, dtype=buffer.dtype, device=buffer.device)
            out[:numel] = buffer
        parts = torch.empty_like(out)
        work = dist.all_to_all_single(parts, out, group=self.group, async_op=True)
        self.exchanged[index] = (work, parts, out, numel)
        return work

    def gather(self, index: int) -> None:
        """Sum bucket ``index``'s parts in rank order and start the all-gather of the sums."""
        work, parts, out, numel = self.exchanged.pop(index)
        self.plane.wait(work, f"bucket {index} (its all-to-all)")  # ``out`` is free again
        world, rank = self.group.size(), self.group.rank()
        tree = TreeSum()
        for part in parts.view(world, -1):  # rank order: the top of the window's tree
            tree.push(part)
        # in place: on a rate-limited link gloo's all-gather took half the time of a broadcast per owner
        # (benchmarks/results/speed-gloo-collectives-2cpu-2026-11-23.md, 4 ranks); the list form copies once more
        own = out.view(world, -1)[rank]
        own.copy_(tree.total())
        self.gathering[index] = (all_gather(out, own, group=self.group, async_op=True), out, numel)

    def reduced(self, bucket: Bucket) -> torch.Tensor:
        if bucket.index in self.exchanged:  # the last bucket: nothing launched after it
            self.gather(bucket.index)
        if bucket.index not in self.gathering:  # one or two ranks: the default all-reduce
            return super().reduced(bucket)
        handle, gathered, numel = self.gathering.pop(bucket.index)
        self.plane.wait(handle, f"bucket {bucket.index} (its all-gather)")
        return gathered if gathered.numel() == numel else gathered[:numel]  # the buffer itself: no copy back

    def reset(self) -> None:
        super().reset()
        self.exchanged.clear()
        self.gathering.clear()


__all__ = ["OrderedLauncher"]
