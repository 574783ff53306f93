"""gradsync: data-parallel gradient synchronization for PyTorch, in pure Python.

``engine`` is one gradient's trip (buckets, the reducer, the launcher, the control plane);
``ddp`` is torch's face on it (the wrapper, construction, ``replace_torch_ddp``, join, compile);
``hooks`` is the comm-hook catalogue; ``accumulate``, ``sharded``, ``elastic``, ``chunked``,
``overlap`` and ``audit`` are features on top; ``tools`` (command line, demo, benchmarks) is not imported here.
docs/architecture.md walks through the tree.
"""
from ._torch_range import UntestedTorchWarning, warn_if_untested

warn_if_untested()  # before the engine imports: a torch that breaks them still gets the warning first

from .hooks import GradBucket, allreduce_hook, bf16_compress_hook, bf16_wire_hook, fp16_compress_hook, noop_hook
from .engine.errors import ReplicaMismatchError, SyncError
from .ddp import DDP, DistributedDataParallel, replace_torch_ddp
from .accumulate import GradientAccumulator
from .chunked import Chunked
from .overlap import overlap_optimizer
from .audit import AuditReport, audit
from .sharded import ShardedDataParallel, ShardedGradScaler, ShardedOptimizer
from . import elastic

__version__ = "0.1.0"
__all__ = [
    "AuditReport", "Chunked", "DDP", "DistributedDataParallel", "GradBucket", "GradientAccumulator",
    "ReplicaMismatchError", "ShardedDataParallel", "ShardedGradScaler", "ShardedOptimizer", "SyncError", "UntestedTorchWarning", "elastic",
    "allreduce_hook", "audit", "bf16_compress_hook", "bf16_wire_hook", "fp16_compress_hook", "noop_hook",
    "overlap_optimizer", "replace_torch_ddp",
]
