"""``GradsyncStrategy``: Lightning's DDP strategy with gradsync's wrapper, by name or as an object."""
from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch

from ._lightning import StrategyRegistry
from lightning.pytorch.strategies import DDPStrategy

from .. import DistributedDataParallel
from .options import (GradsyncBackwardSyncControl, rebind_scheduler, register_names, shard_optimizer, shard_scaler, take_options,
                      wrap)


class GradsyncStrategy(DDPStrategy):
    """``Trainer(strategy=GradsyncStrategy(reduce_dtype=torch.float32))``: DDP through gradsync.

    Takes Lightning's ``DDPStrategy`` arguments (``timeout`` is the process group's) and, as further
    keywords, gradsync's wrapper options (``bucket_cap_mb``, ``find_unused_parameters``,
    ``reduce_dtype``, ``check_finite``, ..., and ``sync_timeout`` for gradsync's ``timeout``); an
    unknown keyword raises ``TypeError`` here. ``sharded=True`` wraps in ``ShardedDataParallel``
    (then also ``max_inflight``, ``staging_budget_mb``) and turns each configured optimizer into a
    ``ShardedOptimizer`` of the same class and groups (``gradient_clip_val`` clips the shards, by the
    global norm or by value; ``precision="16-mixed"`` scales the loss with a ``ShardedGradScaler``). Gradient
    accumulation blocks sync with gradsync's ``no_sync()``;
    ``ddp_comm_hook`` is registered on CPU and GPU alike.
    """

    def __init__(self, *args: Any, sharded: bool = False, **kwargs: Any) -> None:
        self._gradsync_options = take_options(self, DDPStrategy, kwargs, sharded)
        self._sharded = bool(sharded)
        super().__init__(*args, **kwargs)
        self._backward_sync_control = GradsyncBackwardSyncControl()

    @property
    def sharded(self) -> bool:
        return self._sharded

    def _setup_model(self, model: Any) -> DistributedDataParallel:
        return wrap(model, self._sharded, self.determine_ddp_device_ids(), self._gradsync_options)

    def _register_ddp_hooks(self) -> None:
        if self._ddp_comm_hook is None:
            return
        hook = self._ddp_comm_hook
        if self._ddp_comm_wrapper is not None:
            hook = self._ddp_comm_wrapper(hook)
        self.model.register_comm_hook(state=self._ddp_comm_state, hook=hook)

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        if self._sharded and isinstance(self.model, DistributedDataParallel):
            sharded = []
            for optimizer in self.optimizers:
                new = shard_optimizer(self.model, optimizer)
                for config in self.lr_scheduler_configs:
                    rebind_scheduler(config.scheduler, optimizer, new)
                sharded.append(new)
            self.optimizers = sharded
            self._clip_shards()
            shard_scaler(self.precision_plugin)

    def _clip_shards(self) -> None:
        """Gradient clipping on the shards: the precision plugin would clip the optimizer's pieces (no ``.grad`` there)."""
        strategy = self

        def by_norm(optimizer: Any, clip_val: float) -> None:
            strategy.model.clip_grad_norm_(clip_val)  # the global norm over every rank's shard

        def by_value(optimizer: Any, clip_val: float) -> None:
            strategy.model.clip_grad_value_(clip_val)  # element by element: each rank clamps its own shards

        self.precision_plugin.clip_grad_by_norm = by_norm
        self.precision_plugin.clip_grad_by_value = by_value

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        """Manual optimization: ``manual_backward`` runs inside the wrapper's forward, before the
        wrapper noted that a backward may follow; note it here (as Lightning does for torch's DDP)."""
        model, module = self.model, self.lightning_module
        if (isinstance(model, DistributedDataParallel) and module is not None
                and not module.automatic_optimization and torch.is_grad_enabled()):
            model.reducer.prepare_for_backward(closure_loss, model.module.training, True)

    @contextmanager
    def block_backward_sync(self) -> Generator:
        """No gradient communication inside (accumulation); gradsync reads it at the backward too."""
        model = self.model
        with self._backward_sync_control.no_backward_sync(model, isinstance(model, DistributedDataParallel)):
            yield None

    def teardown(self) -> None:
        if isinstance(self.model, DistributedDataParallel):
            self.model = self.lightning_module  # unwrap; DDPStrategy only recognizes torch's class
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        """Register ``"gradsync"`` and ``"gradsync_sharded"`` (and nothing of DDPStrategy's)."""
        register_names(strategy_registry, cls)
