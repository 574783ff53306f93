"""How a sharded bucket's gradients are reduce-scattered and its parameters all-gathered.

On CPU (gloo) the named collectives are slow: in torch 2.13 gloo's ``reduce_scatter_single``
clones its input in the caller's thread and then all-reduces the whole buffer (twice the
bytes of a reduce-scatter), and ``all_gather_single`` copies through a staging buffer. Measured
on 2 gloo ranks (32 MB, ``benchmarks/results/gloo_collectives.md``): reduce-scatter 1.9-3.1x an
all-reduce, all-gather 0.9-1.2x; all-to-all 0.6-0.7x, a broadcast per owner 0.4-0.6x. So on CPU a reduce-scatter is an ``all_to_all_single`` (each rank
receives every rank's copy of its shard, (W-1)/W of the bytes, no reduction) summed locally in
the shard's accumulation dtype, and an all-gather is one in-place broadcast per owner. On other
devices (NCCL) the native collectives are used. Every rank issues the same collectives in the
same order: one per bucket for the gradients, then W per bucket for the parameters.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..core.comm import all_gather, reduce_scatter


def exchanges(device: torch.device) -> bool:
    """Whether buckets on ``device`` use all-to-all and broadcasts instead of the named collectives."""
    return device.type == "cpu"


def start_reduce_scatter(buffer: torch.Tensor, out: torch.Tensor, world_size: int, group: Any,
                         exchange: bool) -> Any:
    """Start reducing ``buffer`` (this rank's bucket sum) into ``out``; return the work.

    ``exchange``: ``out`` (bucket-sized) receives every rank's copy of this rank's shard (``fold``
    sums them); else the buffer is divided first (keeps low-precision sums in range) and ``out``
    (shard-sized) receives the averaged shard.
    """
    if exchange:
        return dist.all_to_all_single(out, buffer, group=group, async_op=True)
    buffer.div_(world_size)
    return reduce_scatter(out, buffer, group=group, async_op=True)


def fold(shard: torch.Tensor, out: torch.Tensor, world_size: int, exchange: bool, fresh: bool) -> None:
    """Add a finished reduce-scatter's ``out`` (the average) into ``shard``; ``fresh``: ``shard`` is zero."""
    if not exchange:
        shard.add_(out)
        return
    copies = out.view(world_size, -1)  # a chain of adds: twice as fast as sum(0) on CPU
    total = shard if fresh and shard.dtype == out.dtype else torch.empty_like(shard)
    if world_size > 1 and total.dtype == out.dtype:
        torch.add(copies[0], copies[1], out=total)
        rest = copies[2:]
    else:  # a low-precision bucket is summed in the shard's wider dtype
        total.copy_(copies[0])
        rest = copies[1:]
    for copy in rest:
        total.add_(copy)
    total.div_(world_size)
    if total is not shard:
        shard.add_(total)


def start_all_gather(flat: torch.Tensor, shard_numel: int, rank: int, group: Any, exchange: bool) -> list[Any]:
    """Start filling ``flat`` from every rank's shard of it (this rank's is in place); return the works."""
    if not exchange:
        own = flat[rank * shard_numel:(rank + 1) * shard_numel]
        return [all_gather(flat, own, group=group, async_op=True)]
    return [dist.broadcast(chunk, src=dist.get_global_rank(group, j), group=group, async_op=True)
            for j, chunk in enumerate(flat.split(shard_numel))]


class BufferPool:
    """Flat buffers released by finished buckets, reused by the next ones (best fit, a view).

    A fresh multi-MB CPU tensor costs page faults on first touch: measured, allocating and
    filling two 25 MB buffers took 1.8x as long as filling two reused ones. The pool keeps at most
    ``limit`` buffers, so it never holds more than the staging peak it saw.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.free: list[torch.Tensor] = []

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        fits = [k for k, t in enumerate(self.free)
                if t.dtype == dtype and t.device == device and numel <= t.numel() <= 2 * numel]
        if not fits:
            return torch.empty(numel, dtype=dtype, device=device)
        return self.free.pop(min(fits, key=lambda k: self.free[k].numel()))[:numel]

    def give(self, *tensors: torch.Tensor | None) -> None:
        for t in tensors:
            if t is not None and t.device.type == "cpu":  # the GPU has a caching allocator
                self.free.append(t._base if t._base is not None else t)
        self.free.sort(key=torch.Tensor.numel)
        del self.free[:max(0, len(self.free) - self.limit)]  # keep the biggest

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.free)
