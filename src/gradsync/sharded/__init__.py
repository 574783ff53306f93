"""ZeRO-2-style sharded gradients and optimizer state, with the same accumulator."""
from .wrapper import ShardedDataParallel
from .optim import ShardedOptimizer

__all__ = ["ShardedDataParallel", "ShardedOptimizer"]
