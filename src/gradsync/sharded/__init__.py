"""ZeRO-2-style sharded gradients and optimizer state, with the same accumulator."""
from .wrapper import ShardedDataParallel
from .optim import ShardedOptimizer
from .amp import ShardedGradScaler

__all__ = ["ShardedDataParallel", "ShardedGradScaler", "ShardedOptimizer"]
