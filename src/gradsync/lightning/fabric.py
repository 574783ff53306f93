"""``GradsyncFabricStrategy``: Fabric's DDP strategy with gradsync's wrapper; ``no_backward_sync`` works."""
from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.strategies import DDPStrategy
from ._lightning import StrategyRegistry

from .. import DistributedDataParallel, ShardedDataParallel
from .options import (GradsyncBackwardSyncControl, rebind_scheduler, register_names, shard_optimizer, shard_scaler, take_options,
                      wrap)


class GradsyncFabricStrategy(DDPStrategy):
    """``Fabric(strategy="gradsync")`` or ``Fabric(strategy=GradsyncFabricStrategy(bucket_cap_mb=50))``.

    Fabric's ``DDPStrategy`` arguments plus gradsync's wrapper options, checked as in
    ``GradsyncStrategy``. ``fabric.no_backward_sync(model)`` enters gradsync's ``no_sync()``.
    ``sharded=True`` wraps in ``ShardedDataParallel``; optimizers set up with the model (or after
    it) become ``ShardedOptimizer`` of the same class and groups, ``fabric.clip_gradients(...,
    max_norm=...)`` clips the shards by the global norm (``clip_val=``: each rank clamps its shards), and fp16
    loss scaling gets a ``ShardedGradScaler``. ``fabric.save``/``load`` see the
    inner module's state dict, as with Fabric's DDP.
    """

    def __init__(self, *args: Any, sharded: bool = False, **kwargs: Any) -> None:
        self._gradsync_options = take_options(self, DDPStrategy, kwargs, sharded)
        self._sharded = bool(sharded)
        self._wrapped: DistributedDataParallel | None = None
        super().__init__(*args, **kwargs)
        self._backward_sync_control = GradsyncBackwardSyncControl()

    def setup_module(self, module: torch.nn.Module) -> DistributedDataParallel:
        self._wrapped = wrap(module, self._sharded, self._determine_ddp_device_ids(), self._gradsync_options)
        return self._wrapped

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if not self._sharded:
            return optimizer
        if self._wrapped is None:
            raise RuntimeError("gradsync: with a sharded strategy set up the model before (or with) its optimizers")
        shard_scaler(self.precision)
        return shard_optimizer(self._wrapped, optimizer)

    def setup_module_and_optimizers(self, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
                                    scheduler: Any = None) -> tuple[torch.nn.Module, list, Any]:
        wrapped = self.setup_module(module)
        new = [self.setup_optimizer(o) for o in optimizers]
        for old, opt in zip(optimizers, new):
            rebind_scheduler(scheduler, old, opt)
        return wrapped, new, scheduler

    def clip_gradients_norm(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, max_norm: float,
                            norm_type: float = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        if not self._sharded:
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)
        return self._unscaled_shards(module, optimizer).clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

    def clip_gradients_value(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        if not self._sharded:
            return super().clip_gradients_value(module, optimizer, clip_val)
        self._unscaled_shards(module, optimizer).clip_grad_value_(clip_val)  # each rank clamps its own shards

    def _unscaled_shards(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> ShardedDataParallel:
        """The sharded model to clip (its shards, not the optimizer's pieces), its gradient unscaled first."""
        self.precision.unscale_gradients(optimizer)
        return module if isinstance(module, ShardedDataParallel) else self._wrapped

    def get_module_state_dict(self, module: torch.nn.Module) -> dict[str, Any]:
        if isinstance(module, DistributedDataParallel):
            module = module.module
        return super().get_module_state_dict(module)

    def load_module_state_dict(self, module: torch.nn.Module, state_dict: dict[str, Any],
                               strict: bool = True) -> None:
        if isinstance(module, DistributedDataParallel):
            module = module.module
        super().load_module_state_dict(module=module, state_dict=state_dict, strict=strict)

    @classmethod
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        """Register ``"gradsync"`` and ``"gradsync_sharded"`` (and nothing of DDPStrategy's)."""
        register_names(strategy_registry, cls)
