"""``torch.nn.utils.clip_grad_norm_`` on a sharded model: clip the shards by their global norm."""
from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist

from .. import process
from .._torch import foreach_mul_


@torch.no_grad()
def clip_shards(reducer: Any, max_norm: float, norm_type: float = 2.0,
                error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip ``reducer``'s gradient shards by their global norm (across all ranks); return that norm."""
    reducer.store.check_ready_to_step()
    norm_type = float(norm_type)
    shards = [b.grad_shard for b in reducer.buckets]
    device = shards[0].device
    if norm_type == float("inf"):
        local = torch.stack([s.abs().max() for s in shards]).max().to(torch.float64)
        op = dist.ReduceOp.MAX
    else:
        local = sum((s.double().abs().pow(norm_type).sum() for s in shards),
                    torch.zeros((), dtype=torch.float64, device=device))
        op = dist.ReduceOp.SUM
    try:
        reducer.wait(dist.all_reduce(local, op=op, group=reducer.group, async_op=True), "the gradient-norm all-reduce")
    except (RuntimeError, dist.DistError) as exc:
        if reducer.attached is None:
            raise
        # a member left after the commit: the survivors re-shard (sharded/regroup.py) and take the norm again
        reducer.attached.recover(exc)
        return clip_shards(reducer, max_norm, norm_type, error_if_nonfinite)
    total = local if norm_type == float("inf") else local.pow(1.0 / norm_type)
    total = total.to(shards[0].dtype)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"gradsync: the total norm of order {norm_type} of the gradients is "
                           "non-finite, so it cannot be clipped. Pass error_if_nonfinite=False "
                           "to clip anyway.")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    foreach_mul_(shards + [b.mirror_shard for b in reducer.buckets if b.mirror_shard is not None], coef)
    return total


@torch.no_grad()
def clip_shards_by_value(reducer: Any, clip_value: float) -> None:
    """Clamp ``reducer``'s gradient shards to [-clip_value, clip_value]: element by element, so no rank needs another's."""
    reducer.store.check_ready_to_step()
    for b in reducer.buckets:
        for shard in (b.grad_shard, b.mirror_shard):
            if shard is not None:
                shard.clamp_(-float(clip_value), float(clip_value))


class _ShardedClip:
    """Answers ``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_`` for one sharded reducer (``process.py``).

    Its ``.grad`` is None after a synced backward: torch's functions would clip nothing (the norm:
    return 0). Given all of the model's parameters, it clips the shards; given part of them, it refuses.
    """

    def __init__(self, reducer: Any):
        self.reducer = weakref.ref(reducer)
        self.ids = frozenset(id(p) for p in reducer.params)

    def clip_grad_norm_for(self, params: list[torch.Tensor], max_norm: float, norm_type: float,
                           error_if_nonfinite: bool, foreach: bool | None) -> torch.Tensor | None:
        reducer = self._given(params, "clip_grad_norm_", "clip_grad_norm_(max_norm), which clips all of them by their global norm")
        return None if reducer is None else clip_shards(reducer, max_norm, norm_type, error_if_nonfinite)

    def clip_grad_value_for(self, params: list[torch.Tensor], clip_value: float, foreach: bool | None) -> bool | None:
        reducer = self._given(params, "clip_grad_value_", "clip_grad_value_(clip_value), which clamps all of them")
        if reducer is None:
            return None
        clip_shards_by_value(reducer, clip_value)
        return True

    def _given(self, params: list[torch.Tensor], function: str, instead: str) -> Any:
        """The reducer if ``params`` are all of its parameters, None if none are; else refuse."""
        reducer = self.reducer()
        given = {id(p) for p in params if id(p) in self.ids}
        if reducer is None or not given:
            return None
        others = [p for p in params if id(p) not in self.ids and p.grad is not None]
        if len(given) < len(self.ids) or others:
            raise RuntimeError(
                f"gradsync: torch.nn.utils.{function} got some, not all, of a "
                "ShardedDataParallel model's parameters (or them mixed with other parameters "
                f"that have gradients). Their gradients live in per-rank shards; call model.{instead}.")
        return reducer


_owners: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # reducer -> its _ShardedClip


def claim_for_sharded(reducer: Any) -> None:
    """Let ``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_`` clip ``reducer``'s shards while it lives."""
    if reducer not in _owners:
        _owners[reducer] = owner = _ShardedClip(reducer)
        process.claim_clip_grad_norm(owner)


def release_for_sharded(reducer: Any) -> None:
    owner = _owners.pop(reducer, None)
    if owner is not None:
        process.release_clip_grad_norm(owner)


__all__ = ["claim_for_sharded", "clip_shards", "clip_shards_by_value", "release_for_sharded"]
