"""Every private name of Lightning that gradsync uses, bound once, each with what breaks without it."""
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.strategies.strategy import _BackwardSyncControl

# The registries Trainer(strategy="gradsync") and Fabric(strategy="gradsync") look names up in: the
# strategies' register_strategies() class methods receive one. Without it: no strategy by name.
StrategyRegistry = _StrategyRegistry

# Fabric's no_backward_sync() protocol, which the strategies' backward-sync control implements.
# Without it: Fabric's no_backward_sync() does not reach gradsync's no_sync.
BackwardSyncControl = _BackwardSyncControl

__all__ = ["BackwardSyncControl", "StrategyRegistry"]
