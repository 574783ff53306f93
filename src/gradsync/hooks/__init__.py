"""Communication hooks, torch's contract: ``hook(state, bucket) -> Future[Tensor]``, one family per file.

``model.register_comm_hook(state, hook)`` takes these, torch's own (``torch.distributed.algorithms.
ddp_comm_hooks``), or yours. The engine never imports this catalogue: a hook that issues exactly one
collective and none from its future's callbacks says so with ``one_collective`` (the reducer then
launches the next bucket without waiting for it).
"""
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_default_hooks

from ..engine.launcher import GradBucket, one_collective
from .default import allreduce_hook, bf16_compress_hook, fp16_compress_hook, noop_hook
from .wire import bf16_wire_hook

for hook in (torch_default_hooks.allreduce_hook, torch_default_hooks.fp16_compress_hook,
              torch_default_hooks.bf16_compress_hook):
    one_collective(hook)  # torch's one-collective hooks, known by name
del hook

__all__ = ["GradBucket", "allreduce_hook", "bf16_compress_hook", "bf16_wire_hook", "fp16_compress_hook",
           "noop_hook", "one_collective"]
