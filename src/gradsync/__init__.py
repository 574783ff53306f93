"""gradsync: data-parallel gradient synchronization for PyTorch, in pure Python."""
from .accumulate import GradientAccumulator
from .chunked import Chunked
from .comm import GradBucket, allreduce_hook, bf16_compress_hook, fp16_compress_hook, noop_hook
from .ddp import DDP, DistributedDataParallel
from .control import SyncError
from .sharded import ShardedDataParallel
from .sharded_optim import ShardedOptimizer

__version__ = "0.1.0"
__all__ = [
    "Chunked", "DDP", "DistributedDataParallel", "GradBucket", "GradientAccumulator",
    "ShardedDataParallel", "ShardedOptimizer", "SyncError",
    "allreduce_hook", "bf16_compress_hook", "fp16_compress_hook", "noop_hook",
]
