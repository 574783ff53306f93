"""Assign parameters to flat communication buckets.

Pure planning: no process group, no tensors allocated. The reducer turns a plan into buffers.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

MiB = 1024 * 1024


def plan_buckets(
    params: Sequence[torch.Tensor],
    bucket_cap_mb: float | Sequence[float] = 25.0,
    first_bucket_cap_mb: float = 1.0,
    order: Sequence[int] | None = None,
) -> list[list[int]]:
    """Return buckets as lists of indices into ``params``.

    Parameters are walked in ``order`` (default: reverse registration order, the order in which
    backward usually produces gradients), grouped by (dtype, device), and a group's bucket is
    closed once it reaches its cap: ``first_bucket_cap_mb`` for the first bucket of the plan,
    ``bucket_cap_mb`` after that. The small first bucket lets communication start early in backward.
    A sequence ``bucket_cap_mb`` (torch's ``bucket_cap_mb_list``) gives each bucket of the plan
    its own cap, the last one repeating; ``first_bucket_cap_mb`` still caps the first.
    Buckets are ordered by the position of their first parameter in the walk, so bucket 0 is the
    one expected to be ready first.
    """
    caps = list(bucket_cap_mb) if isinstance(bucket_cap_mb, Sequence) else [bucket_cap_mb]
    if not caps or min(caps) <= 0 or first_bucket_cap_mb <= 0:
        raise ValueError(
            f"bucket caps must be positive, got bucket_cap_mb={bucket_cap_mb}, "
            f"first_bucket_cap_mb={first_bucket_cap_mb}"
        )
    if order is None:
        order = range(len(params) - 1, -1, -1)
    order = list(order)
    if sorted(order) != list(range(len(params))):
        raise ValueError("order must be a permutation of the parameter indices")

    limits = [first_bucket_cap_mb * MiB] + [c * MiB for c in (caps[1:] or caps)]  # bucket k's cap
    open_buckets: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    closed: list[tuple[int, list[int]]] = []  # (position of first member in the walk, members)
    first_pos: dict[tuple[torch.dtype, torch.device], int] = {}

    for pos, i in enumerate(order):
        p = params[i]
        key = (p.dtype, p.device)
        members, size = open_buckets.get(key, ([], 0))
        if not members:
            first_pos[key] = pos
        members.append(i)
        size += p.numel() * p.element_size()
        limit = limits[min(len(closed), len(limits) - 1)]
        if size >= limit:
            closed.append((first_pos[key], members))
            members, size = [], 0
        open_buckets[key] = (members, size)

    for key, (members, _) in open_buckets.items():
        if members:
            closed.append((first_pos[key], members))
    closed.sort(key=lambda item: item[0])
    return [members for _, members in closed]
