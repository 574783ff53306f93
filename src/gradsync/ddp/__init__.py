"""torch's face: the ``DistributedDataParallel`` wrapper over the engine, and ``replace_torch_ddp``."""
from .wrapper import DDP, DistributedDataParallel
from .compat import replace_torch_ddp

__all__ = ["DDP", "DistributedDataParallel", "replace_torch_ddp"]
