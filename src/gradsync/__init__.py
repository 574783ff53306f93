"""gradsync: data-parallel gradient synchronization for PyTorch, in pure Python.

``gradsync.core`` is the engine (buckets, reducer, comm hooks, the DDP wrapper, join);
``gradsync.layers`` builds on it (accumulation, sharding, chunking); ``gradsync.tools`` holds the
command line, demo, benchmarks and local launcher and is not imported here.
"""
from ._torch_range import UntestedTorchWarning, warn_if_untested

warn_if_untested()  # before the core imports: a torch that breaks them still gets the warning first

from .core import (DDP, DistributedDataParallel, GradBucket, SyncError, allreduce_hook, bf16_compress_hook,
                   bf16_wire_hook, fp16_compress_hook, noop_hook, replace_torch_ddp)
from .layers import Chunked, GradientAccumulator, ShardedDataParallel, ShardedOptimizer, overlap_optimizer
from . import elastic

__version__ = "0.1.0"
__all__ = [
    "Chunked", "DDP", "DistributedDataParallel", "GradBucket", "GradientAccumulator",
    "ShardedDataParallel", "ShardedOptimizer", "SyncError", "UntestedTorchWarning", "elastic",
    "allreduce_hook", "bf16_compress_hook", "bf16_wire_hook", "fp16_compress_hook", "noop_hook",
    "overlap_optimizer", "replace_torch_ddp",
]
