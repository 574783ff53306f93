"""``bf16_wire_hook``: send bfloat16, sum in fp32."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..engine.collectives import exchanges, start_all_gather
from ..engine.launcher import GradBucket, one_collective
from .default import group_or_world, wire_pool


def _average_into(copies: torch.Tensor, wide: torch.dtype, out: torch.Tensor, chunk: int = 1 << 20) -> None:
    """Write the mean of ``copies``' rows into ``out``, summed in ``wide``, a chunk at a time.

    Each row is widened by a copy first: an add that mixes bf16 and fp32 is 3-5x slower on CPU.
    """
    n = out.numel()
    acc = torch.empty(min(chunk, n), dtype=wide, device=out.device)
    row = torch.empty_like(acc)
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        a, r = acc[:end - start], row[:end - start]
        a.copy_(copies[0, start:end])
        for j in range(1, copies.shape[0]):
            a.add_(r.copy_(copies[j, start:end]))
        out[start:end].copy_(a.div_(copies.shape[0]))


def bf16_wire_hook(process_group: dist.ProcessGroup | None, bucket: GradBucket) -> torch.futures.Future:
    """Send bfloat16 (half the bytes) but sum in fp32: an all-to-all of bf16 shards, a local fp32
    sum and division of this rank's shard, then an all-gather of the bf16 average.

    Every value is rounded to bf16 twice (on the way out and on the way back), whatever the world
    size; ``bf16_compress_hook`` also rounds each partial sum of its all-reduce. Issues its
    all-gather from the all-to-all's callback, so buckets reduce one after another. On 2 ranks it
    all-gathers the bf16 buckets instead (the same bytes: each rank sends its bucket once) and
    every rank sums both in fp32: no collective from a callback, so buckets pipeline on the link.
    """
    group = group_or_world(process_group)
    world_size, rank = group.size(), group.rank()
    buffer = bucket.buffer()
    n = buffer.numel()
    if world_size == 2:
        return _wire_gathered(group, rank, buffer)
    shard = -(-n // world_size)
    send = wire_pool.take(shard * world_size, torch.bfloat16, buffer.device)
    send[:n].copy_(buffer.reshape(-1))
    send[n:].zero_()
    recv = wire_pool.take(send.numel(), torch.bfloat16, buffer.device)
    fut = dist.all_to_all_single(recv, send, group=group, async_op=True).get_future()

    def gather(fut: torch.futures.Future) -> torch.Tensor:
        fut.value()  # raises if the all-to-all failed
        wide = torch.promote_types(buffer.dtype, torch.float32)
        _average_into(recv.view(world_size, shard), wide, send[rank * shard:(rank + 1) * shard])
        for work in start_all_gather(send, shard, rank, group, exchanges(buffer.device)):
            work.wait()
        buffer.view(-1).copy_(send[:n])
        wire_pool.give(send, recv)
        return buffer

    return fut.then(gather)


def _wire_gathered(group: Any, rank: int, buffer: torch.Tensor) -> torch.futures.Future:
    """``bf16_wire_hook`` on 2 ranks: all-gather both bf16 copies, average them in fp32 (rank order)."""
    n = buffer.numel()
    rows = wire_pool.take(2 * n, torch.bfloat16, buffer.device)
    rows[rank * n:(rank + 1) * n].copy_(buffer.reshape(-1))
    works = start_all_gather(rows, n, rank, group, exchanges(buffer.device))
    fut = works[0].get_future() if len(works) == 1 else torch.futures.collect_all([w.get_future() for w in works])

    def average(fut: torch.futures.Future) -> torch.Tensor:
        fut.wait()  # raises if a collective failed
        for done in fut.value() if len(works) > 1 else ():
            done.value()
        out = rows[:n]  # chunk by chunk, each chunk read before it is overwritten
        _average_into(rows.view(2, n), torch.promote_types(buffer.dtype, torch.float32), out)  # rounds to bf16
        buffer.view(-1).copy_(out)
        wire_pool.give(rows)
        return buffer

    return fut.then(average)


one_collective(bf16_wire_hook, world_sizes=(2,))  # on 2 ranks its collectives all start in the hook

__all__ = ["bf16_wire_hook"]
