"""torch's default hooks, as gradsync's: average the bucket in its dtype or in a narrower one, or not at all."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..engine.launcher import GradBucket, one_collective
from ..engine.pool import BufferPool


def group_or_world(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return process_group if process_group is not None else dist.group.WORLD


@one_collective
def allreduce_hook(process_group: dist.ProcessGroup | None, bucket: GradBucket) -> torch.futures.Future:
    """Average the bucket across ranks (the default behaviour, as a hook)."""
    group = group_or_world(process_group)
    buffer = bucket.buffer()
    buffer.div_(group.size())  # divide first: keeps low-precision sums in range
    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])


# Wire buffers of the compressing hooks, kept between backwards: a fresh multi-MB CPU tensor
# costs page faults on first touch, which made a bf16 hook slower than sending fp32.
wire_pool = BufferPool(limit=8)


def _compress_hook(dtype: torch.dtype):
    def hook(process_group: dist.ProcessGroup | None, bucket: GradBucket) -> torch.futures.Future:
        group = group_or_world(process_group)
        buffer = bucket.buffer()
        compressed = wire_pool.take(buffer.numel(), dtype, buffer.device)
        compressed.copy_(buffer.view(-1)).div_(group.size())  # round, then divide: as torch's hook
        fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

        def decompress(fut: torch.futures.Future) -> torch.Tensor:
            buffer.view(-1).copy_(fut.value()[0])
            wire_pool.give(compressed)
            return buffer

        return fut.then(decompress)

    return hook


fp16_compress_hook = _compress_hook(torch.float16)
fp16_compress_hook.__name__ = fp16_compress_hook.__qualname__ = "fp16_compress_hook"
fp16_compress_hook.__doc__ = "Reduce the bucket in float16 (half the bytes) and write the average back."
bf16_compress_hook = _compress_hook(torch.bfloat16)
bf16_compress_hook.__name__ = bf16_compress_hook.__qualname__ = "bf16_compress_hook"
bf16_compress_hook.__doc__ = (
    "Reduce the bucket in bfloat16 (half the bytes, fp32's range) and write the average back."
)


@one_collective
def noop_hook(state: Any, bucket: GradBucket) -> torch.futures.Future:
    """Skip communication: every rank keeps its local gradient (for debugging only)."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


fp16_compress_hook = one_collective(fp16_compress_hook)
bf16_compress_hook = one_collective(bf16_compress_hook)

__all__ = ["allreduce_hook", "bf16_compress_hook", "fp16_compress_hook", "noop_hook"]
