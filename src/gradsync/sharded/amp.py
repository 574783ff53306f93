"""``ShardedGradScaler``: AMP loss scaling for a ``ShardedOptimizer``, every rank stepping or skipping alike."""
from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from .._torch import foreach_mul_, unscale_grads_
from .optim import ShardedOptimizer


def shard_grads(optimizer: ShardedOptimizer) -> list[torch.Tensor]:
    """The gradient pieces ``optimizer`` steps: its own shard's and, on an elastic model, the mirrored one's."""
    has_grad = optimizer.reducer.store.has_grad
    sides = [optimizer.own] + ([optimizer.mirror] if optimizer.mirror is not None else [])
    return [piece.grad for side in sides for piece in side.pieces if has_grad[piece.param]]


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for a ``ShardedOptimizer``; the same arguments and calls.

    A rank holds only its shard of the reduced gradient, so torch's scaler would look for inf/NaN
    in one shard; with no gradient on the optimizer's shard pieces it raises "No inf checks were
    recorded". This scaler checks the shards (the mirrored one too), combines the ranks' findings in
    one small all-reduce per ``unscale_`` (bounded by the model's timeout), and unscales: every rank
    skips or takes the step alike, and ``update()`` moves every rank's scale alike. Ranks whose scales differ (a
    joiner's fresh scaler) skip that step and all take the smallest, with a warning. A wrapper holding a
    ``ShardedOptimizer`` as ``.optimizer`` (``GradientAccumulator.wrap_optimizer``) is looked through;
    with any other optimizer it is torch's scaler.
    """

    def _unscale_grads_(self, optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        sharded = optimizer
        while not isinstance(sharded, ShardedOptimizer) and isinstance(getattr(sharded, "optimizer", None), torch.optim.Optimizer):
            sharded = sharded.optimizer  # the accumulator's WindowOptimizer, Accelerate's AcceleratedOptimizer
        if not isinstance(sharded, ShardedOptimizer):
            return unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16)
        optimizer, reducer = sharded, sharded.reducer
        reducer.store.check_ready_to_step()
        grads = shard_grads(optimizer)  # float32 or wider whatever the parameters (store.py): allow_fp16 cannot matter
        device = reducer.buckets[0].grad_shard.device
        # checked before anything changes: a member that leaves in the all-reduce leaves the shards to re-shard
        bad = torch.stack([torch.isfinite(g).all() for g in grads]).logical_not().any() if grads else \
            torch.zeros((), dtype=torch.bool, device=device)
        scale = self._scale.to(device=device, dtype=torch.float32).reshape(())
        flag = torch.stack([bad.to(torch.float32), scale, -scale])  # any inf, the largest scale, minus the smallest
        try:
            reducer.wait(dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=reducer.group, async_op=True),
                         "the loss scaler's inf/NaN check")
        except (RuntimeError, dist.DistError) as exc:
            if reducer.attached is None:
                raise
            reducer.attached.recover(exc)  # the survivors re-shard (regroup.py) and check their new shards
            return self._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        if bool(flag[1] != -flag[2]):  # scaled gradients of different scales were summed: no rank may step on them
            self._agree_on_scale(-flag[2], flag[1])
            flag[0] = 1.0
        found_inf.copy_(flag[0].reshape(found_inf.shape).to(found_inf.device))
        if grads:
            foreach_mul_(grads, inv_scale.to(device))
        return {found_inf.device: found_inf}

    def _agree_on_scale(self, smallest: torch.Tensor, largest: torch.Tensor) -> None:
        """Every rank takes the smallest scale; the step is skipped, so ``update()`` then backs off alike everywhere."""
        warnings.warn(f"gradsync: the ranks' loss scales differed ({smallest.item():g} to {largest.item():g}), so the "
                      "reduced gradient mixed scales: every rank skips this step and takes the smallest scale. A "
                      "replica that joined an elastic job starts with a fresh scaler: register it "
                      "(gradsync.elastic.register('scaler', scaler)) so that it receives the members' scale.",
                      stacklevel=4)
        self._scale.copy_(smallest.reshape(self._scale.shape).to(self._scale))


__all__ = ["ShardedGradScaler", "shard_grads"]
