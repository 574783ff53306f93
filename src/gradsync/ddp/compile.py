"""``torch.compile`` support: the wrapper runs eagerly and shows Dynamo its bucket boundaries.

Dynamo's DDP optimizer (``torch/_dynamo/backends/distributed.py``) splits a compiled graph into
one subgraph per bucket of parameters, so each bucket's gradients leave the compiled backward,
and their hooks launch its collective, while earlier layers still compute. It does so only for
frames compiled while torch's DDP class names an active module, reading that module's
``bucket_bytes_cap``; gradsync's forward presents itself there (``_torch.active_ddp_module``).
Like torch's own wrapper, the wrapper's frames are skipped by Dynamo (run eagerly, the wrapped
module's frames compiled): traced, its counters and flags would become guards, and every switch
between ``no_sync`` micro-steps and the synced step would recompile. The skip rule waits for
Dynamo's import (``process.skip_in_dynamo``): constructing a wrapper does not import the compiler.
"""
from __future__ import annotations

import contextlib
from typing import Any

from .. import process
from .._torch import active_ddp_module, recompile_forward

MiB = 1024 * 1024


def active_ddp(wrapper: Any, first_bucket_bytes: int) -> contextlib.AbstractContextManager:
    """``active_ddp_module``; once ``bucket_cap_mb="auto"`` chose, the module's forward compiles once more: Dynamo
    reads the cap only when it compiles a frame (no guard), and the graph would keep the first forward's splits."""
    auto = wrapper.reducer.auto_caps
    if auto is not None and auto.choice is not None and wrapper.__dict__.get("split_at") is not auto.choice:
        wrapper.__dict__["split_at"] = auto.choice
        recompile_forward(wrapper.module)
    return active_ddp_module(wrapper, first_bucket_bytes)


def skip_wrapper_frames() -> None:
    """Make Dynamo run the wrapper, the engine and torch's adapter eagerly, as it runs torch's DDP."""
    # the packages' directories; layers (Chunked) stay traceable. The adapter too: a backward called
    # inside a compiled function runs the hooks under Dynamo, which otherwise compiled the bucket copy
    # (_torch.foreach_copy_) once per bucket size, up to its recompile limit
    for name in ("gradsync.engine", "gradsync.ddp", "gradsync._torch"):
        process.skip_in_dynamo(name)


def bucket_bytes_caps(bucket_cap_mb: float | tuple[float, ...], first_bucket_cap_mb: float) -> tuple[int, int]:
    """torch's ``bucket_bytes_cap`` and the first bucket's cap in bytes, the first at most the other
    (Dynamo's DDP optimizer asserts it; a list of caps splits at the repeating last one)."""
    cap = bucket_cap_mb[-1] if isinstance(bucket_cap_mb, tuple) else bucket_cap_mb
    return int(cap * MiB), int(min(first_bucket_cap_mb, cap) * MiB)


__all__ = ["active_ddp", "bucket_bytes_caps", "skip_wrapper_frames"]
