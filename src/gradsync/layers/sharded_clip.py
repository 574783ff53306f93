"""``torch.nn.utils.clip_grad_norm_`` on a sharded model: clip the shards by their global norm."""
from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.utils.clip_grad

from ..core._torch import foreach_mul_


@torch.no_grad()
def clip_shards(reducer: Any, max_norm: float, norm_type: float = 2.0,
                error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip ``reducer``'s gradient shards by their global norm (across all ranks); return that norm."""
    reducer.check_ready_to_step()
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
    reducer.wait(dist.all_reduce(local, op=op, group=reducer.group, async_op=True), "the gradient-norm all-reduce")
    total = local if norm_type == float("inf") else local.pow(1.0 / norm_type)
    total = total.to(shards[0].dtype)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"gradsync: the total norm of order {norm_type} of the gradients is "
                           "non-finite, so it cannot be clipped. Pass error_if_nonfinite=False "
                           "to clip anyway.")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    foreach_mul_(shards, coef)
    return total


# torch.nn.utils.clip_grad_norm_ reads .grad, which is None for sharded parameters after a synced
# backward: it would clip nothing and return 0. Once a ShardedReducer exists, torch's function
# clips the shards when given all of a sharded model's parameters, and raises when given part.
_live: weakref.WeakSet = weakref.WeakSet()
_torch_clip_grad_norm_: Any = None


def _install_clip_redirect() -> None:
    global _torch_clip_grad_norm_
    if _torch_clip_grad_norm_ is not None:
        return
    _torch_clip_grad_norm_ = original = torch.nn.utils.clip_grad.clip_grad_norm_

    @functools.wraps(original)
    def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        if _live:
            parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            for reducer in list(_live):
                given = {id(p) for p in parameters if id(p) in reducer._index_of}
                if not given:
                    continue
                others = [p for p in parameters if id(p) not in reducer._index_of and p.grad is not None]
                if len(given) < len(reducer.params) or others:
                    raise RuntimeError(
                        "gradsync: torch.nn.utils.clip_grad_norm_ got some, not all, of a "
                        "ShardedDataParallel model's parameters (or them mixed with other parameters "
                        "that have gradients). Their gradients live in per-rank shards; call "
                        "model.clip_grad_norm_(max_norm), which clips all of them by their global norm.")
                return reducer.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)
        return original(parameters, max_norm, norm_type, error_if_nonfinite, foreach)

    torch.nn.utils.clip_grad.clip_grad_norm_ = clip_grad_norm_
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_

