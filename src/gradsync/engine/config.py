"""The reducer's configuration: one frozen, typed record, built and checked before any collective runs.

``DistributedDataParallel`` keeps torch's constructor (the façade frameworks call) and turns its
arguments into a ``ReducerConfig``; every refusal, the sharded ones included, is raised here, on
every rank, before the first collective. Each value has one owner: the config holds what the user
asked for; the bucket cap actually in use is the bucket store's (``store.caps``), which
``bucket_cap_mb="auto"`` changes through ``Reducer.replan`` and Dynamo's graph splits read.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

Caps = tuple[float | tuple[float, ...], float]  # (bucket_cap_mb or one cap per bucket, first bucket's cap)


@dataclass(frozen=True, kw_only=True, slots=True)
class ReducerConfig:
    """What the reducer was asked to do; frozen (``dataclasses.replace`` makes a changed copy)."""

    bucket_cap_mb: float | tuple[float, ...]
    """Cap of each bucket in MiB (a tuple: torch's ``bucket_cap_mb_list``, the last one repeating)."""
    first_bucket_cap_mb: float
    """Cap of the first bucket in MiB: it launches early in backward."""
    auto_bucket_cap: bool = False
    """``bucket_cap_mb="auto"``: choose the cap from timed synced backwards (``autocap.py``)."""
    user_first_bucket_cap_mb: float | None = None
    """The first cap the user gave explicitly; "auto" then keeps it for every candidate."""
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    skip_all_reduce_unused_params: bool = False
    """Launch no collective for a bucket whose parameters no rank used in the previous synced backward
    (``skip.py``); needs ``find_unused_parameters`` or ``static_graph``."""
    timeout: timedelta
    """Bound on every wait for a collective."""
    reduce_dtype: torch.dtype | None = None
    """Accumulate and reduce in this dtype (``main_grad.py``); None: the parameters' dtype."""
    check_finite: bool = False
    """Check each reduced bucket for NaN/inf before writing it back."""
    sharded: bool = False
    """Reduce-scatter into per-rank gradient shards (``ShardedDataParallel``)."""
    straggler_warning: bool = True
    """Log a warning naming a rank that is the slowest in every recent synced backward (``telemetry.py``)."""
    check_replicas: bool | str = False
    """Compare every bucket's parameters and reduced gradient across ranks in each synced backward (``replicas.py``);
    ``"evict"``: with elastic membership, a minority that disagrees leaves the group instead of every rank raising."""
    deterministic: bool = False
    """Sum the window's micro-steps and the ranks in one fixed tree: the same bits for any power-of-two world
    size (``gradsync/deterministic``)."""
    wrapper_name: str = "DistributedDataParallel"
    """The wrapper's class name, for messages."""

    def __post_init__(self) -> None:
        caps = self.bucket_cap_mb if isinstance(self.bucket_cap_mb, tuple) else (self.bucket_cap_mb,)
        if not caps or min(caps) <= 0 or self.first_bucket_cap_mb <= 0:
            raise ValueError(f"gradsync: bucket caps must be positive sizes in MiB, got bucket_cap_mb="
                             f"{self.bucket_cap_mb}, first_bucket_cap_mb={self.first_bucket_cap_mb}")
        if not isinstance(self.timeout, timedelta) or self.timeout.total_seconds() <= 0:
            raise ValueError(f"timeout must be a positive number of seconds or a timedelta, got {self.timeout!r}")
        if self.sharded and self.gradient_as_bucket_view:
            raise ValueError(
                f"gradsync: {self.wrapper_name} does not take gradient_as_bucket_view=True: gradients "
                "are copied into short-lived staging buckets and released, so there is no full-size "
                "gradient to view. Leave it False.")
        if self.sharded and self.check_finite:
            raise ValueError(f"gradsync: {self.wrapper_name} does not take check_finite=True: the reduced "
                             "gradient lives in per-rank shards; check the shards' norm instead "
                             "(model.clip_grad_norm_ returns it)")
        if self.skip_all_reduce_unused_params and not (self.find_unused_parameters or self.static_graph):
            raise ValueError(
                "gradsync: skip_all_reduce_unused_params=True skips the buckets of parameters that no rank "
                "used, and only find_unused_parameters=True (or static_graph=True) lets a parameter go "
                "unused: without either, every parameter must get a gradient in every synced backward, so "
                "the flag could never apply (torch accepts it and does nothing). Pass "
                "find_unused_parameters=True, or drop the flag.")
        if self.skip_all_reduce_unused_params and self.sharded:
            raise ValueError(f"gradsync: {self.wrapper_name} does not take skip_all_reduce_unused_params=True: "
                             "every bucket's reduce-scatter fills every rank's shard; leave it False")
        if not isinstance(self.check_replicas, bool) and self.check_replicas != "evict":
            raise TypeError(f"gradsync: check_replicas must be True, False or \"evict\", got {self.check_replicas!r}")
        taken = [name for name, on in (("ShardedDataParallel", self.sharded), ("reduce_dtype", self.reduce_dtype is not None),
                 ("skip_all_reduce_unused_params=True", self.skip_all_reduce_unused_params)) if on]
        if self.deterministic and taken:
            raise ValueError(f"gradsync: deterministic=True keeps each micro-step's gradient apart and reduces the "
                             f"buckets in its own order, which {', '.join(taken)} does not allow yet; drop it or "
                             "pass deterministic=False")
        if self.sharded and self.auto_bucket_cap:
            raise ValueError(f"gradsync: {self.wrapper_name} lays its buckets out once, at construction, so it "
                             "cannot choose the cap from measured backwards; pass bucket_cap_mb as a size in MiB")

    @property
    def caps(self) -> Caps:
        """The caps the buckets are first planned with."""
        return self.bucket_cap_mb, self.first_bucket_cap_mb


def resolve_reduce_dtype(reduce_dtype: Any, params: Sequence[torch.Tensor]) -> torch.dtype | None:
    """Return ``reduce_dtype`` after checking it is a floating dtype at least as wide as every parameter's."""
    if reduce_dtype is None:
        return None
    if not isinstance(reduce_dtype, torch.dtype) or not reduce_dtype.is_floating_point:
        raise TypeError(f"gradsync: reduce_dtype must be a floating-point torch.dtype such as torch.float32, "
                        f"got {reduce_dtype!r}")
    complex_ = sorted({str(p.dtype) for p in params if p.is_complex()})
    if complex_:
        raise ValueError(f"gradsync: reduce_dtype applies to real floating-point parameters, and the model has "
                         f"{', '.join(complex_)} parameters; their gradients reduce in their own dtype: pass "
                         "reduce_dtype=None")
    narrower = sorted({str(p.dtype) for p in params if torch.promote_types(p.dtype, reduce_dtype) != reduce_dtype})
    if narrower:
        raise ValueError(f"gradsync: reduce_dtype={reduce_dtype} cannot hold the gradients of {', '.join(narrower)} "
                         "parameters without losing precision; pass a dtype at least as wide as every "
                         "parameter's (e.g. torch.float32 for bf16/fp16 parameters), or None")
    return reduce_dtype


__all__ = ["Caps", "ReducerConfig", "resolve_reduce_dtype"]
