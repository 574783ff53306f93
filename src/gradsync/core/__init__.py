"""The core engine: bucket planning, the reducer, comm hooks, the DDP wrapper and join.

Nothing here imports the layers (``gradsync.layers``) or the tools (``gradsync.tools``).
"""
from .comm import GradBucket, allreduce_hook, bf16_compress_hook, bf16_wire_hook, fp16_compress_hook, noop_hook
from .control import SyncError
from .ddp import DDP, DistributedDataParallel
from .compat import replace_torch_ddp

__all__ = ["DDP", "DistributedDataParallel", "GradBucket", "SyncError",
           "allreduce_hook", "bf16_compress_hook", "bf16_wire_hook", "fp16_compress_hook", "noop_hook", "replace_torch_ddp"]
