"""Communication hooks and the bucket object they receive.

A hook has torch's signature, ``hook(state, bucket) -> torch.futures.Future[Tensor]``, and the
future's tensor is the bucket's reduced (averaged) gradient. ``GradBucket`` answers the same
methods as ``torch.distributed.GradBucket``, so torch's own hooks run unchanged.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .pool import BufferPool

CommHook = Callable[[Any, "GradBucket"], torch.futures.Future]

# torch 2.13 renamed the *_tensor collectives; older releases (>= 2.4) only have the old names
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class GradBucket:
    """One flat bucket of gradients, as handed to a communication hook."""

    __slots__ = ("_index", "_buffer", "_gradients", "_parameters", "_is_last")

    def __init__(self, index: int, buffer: torch.Tensor, gradients: list[torch.Tensor],
                 parameters: list[torch.Tensor], is_last: bool):
        self._index = index
        self._buffer = buffer
        self._gradients = gradients
        self._parameters = parameters
        self._is_last = is_last

    def index(self) -> int:
        """Return the bucket's position in launch order (0 is launched first)."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """Return the flat tensor holding this bucket's gradients."""
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        """Return each parameter's gradient as a view into ``buffer()``."""
        return self._gradients

    def parameters(self) -> list[torch.Tensor]:
        """Return the parameters, in the same order as ``gradients()``."""
        return self._parameters

    def is_last(self) -> bool:
        """Return True for the last bucket launched in an iteration."""
        return self._is_last

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Replace the bucket's contents with ``tensor`` (same number of elements)."""
        if tensor.numel() != self._buffer.numel():
            raise ValueError(
                f"set_buffer on bucket {self._index}: expected {self._buffer.numel()} elements, "
                f"got {tensor.numel()}"
            )
        self._buffer.copy_(tensor.reshape(self._buffer.shape))


def _group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return process_group if process_group is not None else dist.group.WORLD


def allreduce_hook(process_group: dist.ProcessGroup | None, bucket: GradBucket) -> torch.futures.Future:
    """Average the bucket across ranks (the default behaviour, as a hook)."""
    group = _group(process_group)
    buffer = bucket.buffer()
    buffer.div_(group.size())  # divide first: keeps low-precision sums in range
    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])


# Wire buffers of the compressing hooks, kept between backwards: a fresh multi-MB CPU tensor
# costs page faults on first touch, which made a bf16 hook slower than sending fp32.
_wire = BufferPool(limit=8)


def _compress_hook(dtype: torch.dtype):
    def hook(process_group: dist.ProcessGroup | None, bucket: GradBucket) -> torch.futures.Future:
        group = _group(process_group)
        buffer = bucket.buffer()
        compressed = _wire.take(buffer.numel(), dtype, buffer.device)
        compressed.copy_(buffer.view(-1)).div_(group.size())  # round, then divide: as torch's hook
        fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

        def decompress(fut: torch.futures.Future) -> torch.Tensor:
            buffer.view(-1).copy_(fut.value()[0])
            _wire.give(compressed)
            return buffer

        return fut.then(decompress)

    return hook


fp16_compress_hook = _compress_hook(torch.float16)
fp16_compress_hook.__name__ = "fp16_compress_hook"
fp16_compress_hook.__doc__ = "Reduce the bucket in float16 (half the bytes) and write the average back."
bf16_compress_hook = _compress_hook(torch.bfloat16)
bf16_compress_hook.__name__ = "bf16_compress_hook"
bf16_compress_hook.__doc__ = (
    "Reduce the bucket in bfloat16 (half the bytes, fp32's range) and write the average back."
)


def exchanges(device: torch.device) -> bool:
    """Whether collectives on ``device`` use all-to-all and broadcasts instead of the named ones.

    On CPU (gloo, torch 2.13) ``reduce_scatter_single`` clones its input and all-reduces the whole
    buffer, and ``all_gather_single`` copies through a staging buffer; an all-to-all and one
    broadcast per owner move the same bytes faster (``benchmarks/results/gloo_collectives.md``).
    """
    return device.type == "cpu"


def start_all_gather(flat: torch.Tensor, shard_numel: int, rank: int, group: Any, exchange: bool) -> list[Any]:
    """Start filling ``flat`` from every rank's shard of it (this rank's is in place); return the works."""
    if not exchange:
        own = flat[rank * shard_numel:(rank + 1) * shard_numel]
        return [all_gather(flat, own, group=group, async_op=True)]
    return [dist.broadcast(chunk, src=dist.get_global_rank(group, j), group=group, async_op=True)
            for j, chunk in enumerate(flat.split(shard_numel))]


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
    group = _group(process_group)
    world_size, rank = group.size(), group.rank()
    buffer = bucket.buffer()
    n = buffer.numel()
    if world_size == 2:
        return _wire_gathered(group, rank, buffer)
    shard = -(-n // world_size)
    send = _wire.take(shard * world_size, torch.bfloat16, buffer.device)
    send[:n].copy_(buffer.reshape(-1))
    send[n:].zero_()
    recv = _wire.take(send.numel(), torch.bfloat16, buffer.device)
    fut = dist.all_to_all_single(recv, send, group=group, async_op=True).get_future()

    def gather(fut: torch.futures.Future) -> torch.Tensor:
        fut.value()  # raises if the all-to-all failed
        wide = torch.promote_types(buffer.dtype, torch.float32)
        _average_into(recv.view(world_size, shard), wide, send[rank * shard:(rank + 1) * shard])
        for work in start_all_gather(send, shard, rank, group, exchanges(buffer.device)):
            work.wait()
        buffer.view(-1).copy_(send[:n])
        _wire.give(send, recv)
        return buffer

    return fut.then(gather)


def _wire_gathered(group: Any, rank: int, buffer: torch.Tensor) -> torch.futures.Future:
    """``bf16_wire_hook`` on 2 ranks: all-gather both bf16 copies, average them in fp32 (rank order)."""
    n = buffer.numel()
    rows = _wire.take(2 * n, torch.bfloat16, buffer.device)
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
        _wire.give(rows)
        return buffer

    return fut.then(average)


def noop_hook(state: Any, bucket: GradBucket) -> torch.futures.Future:
    """Skip communication: every rank keeps its local gradient (for debugging only)."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def issues_one_collective(hook: CommHook, world_size: int | None = None) -> bool:
    """Return True for hooks known to issue one collective and none from their futures' callbacks
    (``bf16_wire_hook`` on ``world_size`` 2: its collectives all start in the hook).

    Other hooks (e.g. torch's ``powerSGD_hook``) may start collectives from a callback, on gloo's
    thread, when an earlier collective completes; the reducer then issues nothing else until
    that bucket's future is done, so every rank issues collectives in the same order.
    """
    hook = getattr(hook, "func", hook)  # functools.partial
    if hook is bf16_wire_hook and world_size == 2:
        return True
    return hook in _ONE_COLLECTIVE or getattr(hook, "_gradsync_one_collective", False)


def one_collective(hook: CommHook) -> CommHook:
    """Declare that ``hook`` issues one collective and none from its future's callbacks.

    Then the reducer launches the next bucket without waiting for this one's future.
    """
    hook._gradsync_one_collective = True
    return hook


_ONE_COLLECTIVE = {allreduce_hook, fp16_compress_hook, bf16_compress_hook, noop_hook}
try:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as _torch_hooks
    _ONE_COLLECTIVE |= {_torch_hooks.allreduce_hook, _torch_hooks.fp16_compress_hook,
                        _torch_hooks.bf16_compress_hook}
except ImportError:  # torch built without distributed hooks: only gradsync's own are known
    pass

