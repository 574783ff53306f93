"""How a sharded bucket's gradients are reduce-scattered and its parameters all-gathered.

On CPU (gloo) the named collectives are slow: in torch 2.13 gloo's ``reduce_scatter_single``
clones its input in the caller's thread and then all-reduces the whole buffer (twice the
bytes of a reduce-scatter), and ``all_gather_single`` copies through a staging buffer. Measured
on 2 gloo ranks (32 MB, ``benchmarks/results/speed-gloo-collectives-2cpu-2026-11-23.md``): reduce-scatter 1.9-3.1x an
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

from ..engine.collectives import exchanges, reduce_scatter, start_all_gather
from ..engine.pool import BufferPool

__all__ = ["BufferPool", "exchanges", "fold", "start_all_gather", "start_reduce_scatter"]


def start_reduce_scatter(buffer: torch.Tensor, out: torch.Tensor, world_size: int, group: Any,
                         exchange: bool, keep: bool = False) -> Any:
    """Start reducing ``buffer`` (this rank's bucket sum) into ``out``; return the work.

    ``exchange``: ``out`` (bucket-sized) receives every rank's copy of this rank's shard (``fold``
    sums them); else the buffer is divided first (keeps low-precision sums in range; into a copy with
    ``keep``, which leaves ``buffer`` whole to be reduced again) and ``out`` (shard-sized) receives the
    averaged shard.
    """
    if exchange:
        return dist.all_to_all_single(out, buffer, group=group, async_op=True)
    divided = buffer.div(world_size) if keep else buffer.div_(world_size)
    return reduce_scatter(out, divided, group=group, async_op=True)


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
