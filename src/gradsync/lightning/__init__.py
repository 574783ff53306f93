"""Lightning and Fabric strategies by name: ``import gradsync.lightning`` registers them.

::

    import gradsync.lightning                      # imports lightning; `import gradsync` does not
    Trainer(strategy="gradsync")                   # gradsync.DistributedDataParallel
    Trainer(strategy="gradsync_sharded")           # ShardedDataParallel + ShardedOptimizer
    Trainer(strategy=gradsync.lightning.GradsyncStrategy(reduce_dtype=torch.float32))
    Fabric(strategy="gradsync")                    # fabric.no_backward_sync(model) works

Unlike ``replace_torch_ddp()`` nothing process-wide changes: torch's DDP class is left alone, the
strategies build gradsync's wrapper themselves and block gradient sync with its ``no_sync()``.
Lightning starts the other ranks by re-running the script, so each rank imports this module.
"""
from __future__ import annotations

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from .fabric import GradsyncFabricStrategy
from .options import GradsyncBackwardSyncControl
from .trainer import GradsyncStrategy

__all__ = ["GradsyncBackwardSyncControl", "GradsyncFabricStrategy", "GradsyncStrategy", "register"]


def register() -> None:
    """(Re-)register ``"gradsync"`` and ``"gradsync_sharded"`` with the Trainer's and Fabric's registries."""
    GradsyncStrategy.register_strategies(StrategyRegistry)
    GradsyncFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)


register()
