"""Layers on top of the core engine: gradient accumulation, sharded gradients, chunked modules."""
from .accumulate import GradientAccumulator
from .chunked import Chunked
from .overlap import overlap_optimizer
from .sharded import ShardedDataParallel
from .sharded_optim import ShardedOptimizer

__all__ = ["Chunked", "GradientAccumulator", "ShardedDataParallel", "ShardedOptimizer", "overlap_optimizer"]
