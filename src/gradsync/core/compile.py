"""``torch.compile`` support: the wrapper runs eagerly and shows Dynamo its bucket boundaries.

Dynamo's DDP optimizer (``torch/_dynamo/backends/distributed.py``) splits a compiled graph into
one subgraph per bucket of parameters, so each bucket's gradients leave the compiled backward,
and their hooks launch its collective, while earlier layers still compute. It does so only for
frames compiled while ``torch.nn.parallel.DistributedDataParallel._get_active_ddp_module()``
names a module, reading that module's ``bucket_bytes_cap``; gradsync's forward presents itself
there. Like torch's own wrapper, the wrapper's frames are skipped by Dynamo (run eagerly, the
wrapped module's frames compiled): traced, its counters and flags would become guards, and every
switch between ``no_sync`` micro-steps and the synced step would recompile.
"""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch.distributed as dist
from torch import nn

MiB = 1024 * 1024
_skipping = False


def skip_wrapper_frames() -> None:
    """Make Dynamo run ``gradsync.core`` (wrapper, reducer, hooks) eagerly, as it runs torch's DDP."""
    global _skipping
    if not _skipping:
        import torch._dynamo.trace_rules as rules
        rules.add("gradsync.core")  # skips the package's directory; layers (Chunked) stay traceable
        _skipping = True


def bucket_bytes_caps(bucket_cap_mb: float | tuple[float, ...], first_bucket_cap_mb: float) -> tuple[int, int]:
    """torch's ``bucket_bytes_cap`` and the first bucket's cap in bytes, the first at most the other
    (Dynamo's DDP optimizer asserts it; a list of caps splits at the repeating last one)."""
    cap = bucket_cap_mb[-1] if isinstance(bucket_cap_mb, tuple) else bucket_cap_mb
    return int(cap * MiB), int(min(first_bucket_cap_mb, cap) * MiB)


@contextlib.contextmanager
def active_ddp(ddp: nn.Module, first_bucket_bytes_cap: int) -> Iterator[None]:
    """Inside: frames Dynamo compiles are split at ``ddp``'s bucket boundaries (torch's
    ``_inside_ddp_forward``); the optimizer takes the first cap from torch's default, set here."""
    torch_ddp = nn.parallel.DistributedDataParallel
    old, old_first = torch_ddp._active_ddp_module, dist._DEFAULT_FIRST_BUCKET_BYTES
    torch_ddp._active_ddp_module, dist._DEFAULT_FIRST_BUCKET_BYTES = ddp, first_bucket_bytes_cap
    try:
        yield
    finally:
        torch_ddp._active_ddp_module, dist._DEFAULT_FIRST_BUCKET_BYTES = old, old_first


def in_compiled_autograd() -> bool:
    """True while compiled autograd runs a backward; our hooks then run eagerly between its graphs,
    and its engine never runs the callbacks queued with ``queue_callback``."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return ca is not None and ca.in_compiled_autograd_region
