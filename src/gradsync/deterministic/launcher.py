"""Each bucket reduced in one fixed order: all-to-all, the parts summed in rank order, all-gather.

A ring or tree all-reduce adds the ranks' buckets in an order its algorithm picks, which changes with
the world size. Here the bucket is cut into W chunks; an all-to-all gives rank c every rank's chunk c,
which it sums in rank order (``TreeSum``: the top of the window's tree); an all-gather returns every
summed chunk to every rank. Each rank sends and receives (W - 1)/W of the bucket twice: the bytes of a
ring all-reduce. The all-to-all starts when the bucket is full, the sum and the all-gather run when
its result is taken, in bucket order on every rank. Two ranks need none of it: a sum of two values has
one order, so their buckets take the default all-reduce.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..engine.launcher import BucketLauncher
from ..engine.store import Bucket
from .tree import TreeSum


class OrderedLauncher(BucketLauncher):
    """``BucketLauncher`` whose every bucket is reduced in rank order; comm hooks are refused."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.in_flight: dict[int, tuple[torch.Tensor, int]] = {}  # bucket -> (all-to-all output, numel)

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
        chunk = -(-buffer.numel() // world)
        sent = torch.zeros(chunk * world, dtype=buffer.dtype, device=buffer.device)
        sent[:buffer.numel()] = buffer
        parts = torch.empty_like(sent)
        self.in_flight[index] = (parts, buffer.numel())
        return dist.all_to_all_single(parts, sent, group=self.group, async_op=True)

    def _result(self, bucket: Bucket) -> torch.Tensor:
        self.plane.wait(bucket.handle, f"bucket {bucket.index} (its all-to-all)")
        if bucket.index not in self.in_flight:  # one or two ranks: reduced in place
            return bucket.buffer if bucket.wire is None else bucket.wire
        parts, numel = self.in_flight.pop(bucket.index)
        world = self.group.size()
        tree = TreeSum()
        for part in parts.view(world, -1):  # rank order: the top of the window's tree
            tree.push(part)
        mine = tree.total()
        gathered = torch.empty_like(parts)
        work = dist.all_gather(list(gathered.view(world, -1)), mine, group=self.group, async_op=True)
        self.plane.wait(work, f"bucket {bucket.index} (its all-gather)")
        return gathered[:numel]

    def reset(self) -> None:
        self.in_flight.clear()


__all__ = ["OrderedLauncher"]
