"""The collectives the sharded store and the wire hooks share, under the names of this torch, and objects as the
bytes a collective sends (``serialized``: the state a joiner receives, what members hold at a re-shard).

On CPU (gloo, torch 2.13) ``reduce_scatter_single`` clones its input and all-reduces the whole buffer,
and ``all_gather_single`` copies through a staging buffer; an all-to-all and one broadcast per owner
move the same bytes faster (``exchanges``).
"""
from __future__ import annotations

import io
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

# torch 2.13 renamed the *_tensor collectives; older releases (>= 2.4) only have the old names
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def exchanges(device: torch.device) -> bool:
    """Whether collectives on ``device`` use all-to-all and broadcasts instead of the named ones.

    On CPU (gloo, torch 2.13) ``reduce_scatter_single`` clones its input and all-reduces the whole
    buffer, and ``all_gather_single`` copies through a staging buffer; an all-to-all and one
    broadcast per owner move the same bytes faster (``benchmarks/results/speed-gloo-collectives-2cpu-2026-11-23.md``).
    """
    return device.type == "cpu"


def start_all_gather(flat: torch.Tensor, shard_numel: int, rank: int, group: Any, exchange: bool) -> list[Any]:
    """Start filling ``flat`` from every rank's shard of it (this rank's is in place); return the works."""
    if not exchange:
        own = flat[rank * shard_numel:(rank + 1) * shard_numel]
        return [all_gather(flat, own, group=group, async_op=True)]
    return [dist.broadcast(chunk, src=dist.get_global_rank(group, j), group=group, async_op=True)
            for j, chunk in enumerate(flat.split(shard_numel))]


class _Chunks:
    """Where ``torch.save`` writes: each record copied by torch, which releases the GIL (a ``BytesIO`` copied and grew
    it under the GIL, ~3 s a GB, while a replica's heartbeat thread waited for it)."""

    def __init__(self):
        self.parts: list[torch.Tensor] = []

    def write(self, data: Any) -> int:
        if len(data):
            with warnings.catch_warnings():  # a read-only view of the writer's memory, copied at once
                warnings.simplefilter("ignore", UserWarning)
                self.parts.append(torch.frombuffer(data, dtype=torch.uint8).clone())
        return len(data)

    def flush(self) -> None:
        pass


class _Reader(io.RawIOBase):
    """What ``torch.load`` reads a blob from: each record copied out by torch (GIL released)."""

    def __init__(self, blob: torch.Tensor):
        super().__init__()
        self.blob, self.pos = blob, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = offset + (self.pos if whence == io.SEEK_CUR else self.blob.numel() if whence == io.SEEK_END else 0)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = max(min(len(buffer), self.blob.numel() - self.pos), 0)
        if n:
            torch.frombuffer(buffer, dtype=torch.uint8)[:n].copy_(self.blob[self.pos:self.pos + n])
        self.pos += n
        return n


def serialized(obj: Any) -> torch.Tensor:
    """``torch.save(obj)`` as a uint8 tensor, without holding the GIL for longer than a record's copy call."""
    sink = _Chunks()
    torch.save(obj, sink)
    return torch.cat(sink.parts) if sink.parts else torch.empty(0, dtype=torch.uint8)


def broadcast_bytes(blob: torch.Tensor | None, src: int, group: Any, wait: Callable[[Any], None]) -> torch.Tensor:
    """Rank ``src``'s ``blob`` (uint8; None elsewhere) on every rank of ``group``: its size, then its bytes."""
    size = torch.tensor([blob.numel() if blob is not None else 0], dtype=torch.int64)
    wait(dist.broadcast(size, src=src, group=group, async_op=True))
    if blob is None:
        blob = torch.empty(int(size), dtype=torch.uint8)
    wait(dist.broadcast(blob, src=src, group=group, async_op=True))
    return blob


def deserialized(blob: torch.Tensor, map_location: Any = None) -> Any:
    """The object ``serialized`` made ``blob`` of, each record copied out by torch (``map_location``: torch.load's)."""
    return torch.load(_Reader(blob), map_location=map_location, weights_only=False)


__all__ = ["all_gather", "broadcast_bytes", "deserialized", "exchanges", "reduce_scatter", "serialized", "start_all_gather"]
