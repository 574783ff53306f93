"""The collectives the sharded store and the wire hooks share, under the names of this torch.

On CPU (gloo, torch 2.13) ``reduce_scatter_single`` clones its input and all-reduces the whole buffer,
and ``all_gather_single`` copies through a staging buffer; an all-to-all and one broadcast per owner
move the same bytes faster (``exchanges``).
"""
from __future__ import annotations

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


__all__ = ["all_gather", "exchanges", "reduce_scatter", "start_all_gather"]
