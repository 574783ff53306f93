"""torch's constructor keywords, resolved with torch 2.13's meaning, into the reducer's typed config.

Process group or device mesh, buffer sync flags, bucket caps, ``device_ids``; every refusal is raised
while the ``ReducerConfig`` is built, before the first collective.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import process
from .._torch import TorchDDP, default_first_bucket_bytes, device_index, group_timeout
from ..engine.config import ReducerConfig, resolve_reduce_dtype
from ..engine.layout import MiB
from .construct import check_broadcast_buffers, check_wrappable

DEFAULT_BUCKET_CAP_MB = 25.0
DEFAULT_FIRST_BUCKET_CAP_MB = default_first_bucket_bytes() / MiB


@dataclass(frozen=True, kw_only=True)
class Resolved:
    """What the wrapper keeps from its constructor's keywords."""

    process_group: dist.ProcessGroup
    device_ids: list[int] | None
    output_device: int | None
    forward_sync_buffers: bool
    init_sync_buffers: bool
    reduced: list[str]  # the parameters the reducer averages
    delayed: dict[str, nn.Parameter]  # delay_all_reduce_named_params
    device: torch.device
    config: ReducerConfig


def resolve(wrapper: type, module: nn.Module, *, refuse: tuple[type, ...], device_ids: Any, output_device: Any, broadcast_buffers: Any,
            process_group: Any, bucket_cap_mb: Any, find_unused_parameters: bool, check_reduction: bool,
            gradient_as_bucket_view: bool, static_graph: bool, delay_all_reduce_named_params: Any,
            param_to_hook_all_reduce: Any, mixed_precision: Any, device_mesh: Any,
            skip_all_reduce_unused_params: bool, bucket_cap_mb_list: Any, forward_sync_buffers: Any,
            first_bucket_cap_mb: Any, timeout: Any, check_finite: bool, reduce_dtype: Any,
            straggler_warning: bool, sharded: bool, check_replicas: bool = False, deterministic: bool = False) -> Resolved:
    """Check and resolve a wrapper's constructor keywords (``wrapper`` is the class being built; a module
    that already is a ``refuse`` wrapper is refused)."""
    if mixed_precision is not None:
        raise NotImplementedError("gradsync: mixed_precision (torch's experimental _MixedPrecision) is "
                                  "not supported; keep parameters in one dtype or use torch.autocast")
    if (delay_all_reduce_named_params is None) != (param_to_hook_all_reduce is None):
        raise ValueError("delay_all_reduce_named_params and param_to_hook_all_reduce "
                         "need to be set at the same time.")
    if check_replicas == "evict" and (process.state.replica is None or process_group is not None or device_mesh is not None):
        raise ValueError("gradsync: check_replicas=\"evict\" removes a replica that disagrees with the majority from "
                         "an elastic job, and this model is not in one: call gradsync.elastic.init_process_group() "
                         "under gradsync run and build it on the default group, or pass check_replicas=True")
    if check_reduction:
        warnings.warn("The `check_reduction` argument in `DistributedDataParallel` module is "
                      "deprecated. Please avoid using it.", FutureWarning, stacklevel=3)
    group = resolve_group(process_group, device_mesh)
    trainable = check_wrappable(module, (*refuse, TorchDDP))
    # a replica of gradsync.elastic reduces them in its buckets, so they commit with the rest: the delay changes
    # when they are averaged, not what
    follows_replica = process.state.replica is not None and process_group is None and device_mesh is None
    delayed = {} if follows_replica else by_object(delay_all_reduce_named_params or (), trainable)
    reduced = [n for n, _ in trainable if n not in delayed]
    if not reduced:
        raise NotImplementedError("gradsync: delay_all_reduce_named_params names every trainable "
                                  "parameter; leave at least one to the reducer")
    ids, output = resolve_device_ids(device_ids, output_device, [p for _, p in trainable])
    forward_sync, init_sync = resolve_buffer_sync(broadcast_buffers, forward_sync_buffers)
    if forward_sync or init_sync:
        check_broadcast_buffers(module)
    device = trainable[0][1].device
    auto = resolve_auto_cap(bucket_cap_mb, bucket_cap_mb_list)
    caps, first_cap = resolve_bucket_caps(None if auto else bucket_cap_mb, bucket_cap_mb_list, first_bucket_cap_mb)
    config = ReducerConfig(
        bucket_cap_mb=caps, first_bucket_cap_mb=first_cap, auto_bucket_cap=auto,
        user_first_bucket_cap_mb=first_bucket_cap_mb, find_unused_parameters=find_unused_parameters,
        gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph,
        skip_all_reduce_unused_params=bool(skip_all_reduce_unused_params),
        timeout=resolve_timeout(timeout, group, device),
        reduce_dtype=resolve_reduce_dtype(reduce_dtype, [p for _, p in trainable]), check_finite=check_finite,
        sharded=sharded, straggler_warning=bool(straggler_warning), wrapper_name=wrapper.__name__,
        check_replicas=check_replicas, deterministic=bool(deterministic))
    return Resolved(process_group=group, device_ids=ids, output_device=output, forward_sync_buffers=forward_sync,
                    init_sync_buffers=init_sync, reduced=reduced, delayed=delayed, device=device, config=config)


def resolve_timeout(timeout: timedelta | float | None, group: dist.ProcessGroup,
                    device: torch.device) -> timedelta:
    """Return ``timeout`` as a timedelta; None means the process group's own timeout."""
    if timeout is None:
        return group_timeout(group, device)
    if isinstance(timeout, (int, float)):
        timeout = timedelta(seconds=timeout)
    if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be a positive number of seconds or a timedelta, got {timeout!r}")
    return timeout


def resolve_group(process_group: dist.ProcessGroup | None, device_mesh: Any) -> dist.ProcessGroup:
    """Return the group to reduce over: ``process_group``, a 1-D ``device_mesh``'s, or the default one."""
    if process_group is not None and device_mesh is not None:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
    if device_mesh is None:
        group = process_group if process_group is not None else dist.group.WORLD
    elif device_mesh.ndim != 1:
        raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}. Pass the "
                           "data-parallel dimension, e.g. mesh['dp'].")
    else:
        group = device_mesh.get_group(mesh_dim=0)
    if process_group is not None and dist.is_initialized() and dist.get_rank(group) < 0:
        raise ValueError(f"gradsync: this process (global rank {dist.get_rank()}) is not a member of the "
                         "process_group it was given (dist.new_group returns a placeholder on the ranks outside "
                         "the group). Wrap the model only on the group's ranks, or pass the group this rank is in.")
    return group


def by_object(named: Any, trainable: list[tuple[str, nn.Parameter]]) -> dict[str, nn.Parameter]:
    """``delay_all_reduce_named_params`` under the module's own names, matched by parameter as torch matches them (a
    module compiled before wrapping names its parameters ``_orig_mod.``...)."""
    name_of, delayed = {id(p): n for n, p in trainable}, {}
    for name, p in named:
        if id(p) not in name_of:
            raise ValueError(f"gradsync: delay_all_reduce_named_params names {name!r}, a tensor that is not a trainable "
                             "parameter of the wrapped module; pass (name, parameter) pairs of module.named_parameters()")
        delayed[name_of[id(p)]] = p
    return delayed


def resolve_buffer_sync(broadcast_buffers: bool | None, forward_sync_buffers: bool | None) -> tuple[bool, bool]:
    """Return (sync buffers at runtime, include buffers in the init sync), warning like torch 2.13."""
    if broadcast_buffers is not None:
        if forward_sync_buffers is not None:
            warnings.warn("`broadcast_buffers` is deprecated and ignored because `forward_sync_buffers` "
                          "was given too; pass only `forward_sync_buffers`.", FutureWarning, stacklevel=3)
        else:
            warnings.warn("`broadcast_buffers` is deprecated; use `forward_sync_buffers`. Unlike "
                          "`broadcast_buffers=False`, `forward_sync_buffers=False` still syncs buffers "
                          "at construction (keep `broadcast_buffers=False` for rank-local buffers).",
                          FutureWarning, stacklevel=3)
    if forward_sync_buffers is not None:
        return bool(forward_sync_buffers), True
    sync = True if broadcast_buffers is None else bool(broadcast_buffers)
    return sync, sync


def resolve_auto_cap(bucket_cap_mb: Any, bucket_cap_mb_list: Any) -> bool:
    """Return whether ``bucket_cap_mb="auto"`` was asked for; raise on what cannot go with it."""
    if not isinstance(bucket_cap_mb, str):
        return False
    if bucket_cap_mb != "auto":
        raise ValueError(f"gradsync: bucket_cap_mb must be a size in MiB or \"auto\", got {bucket_cap_mb!r}")
    if bucket_cap_mb_list is not None:
        raise ValueError("gradsync: bucket_cap_mb=\"auto\" chooses one cap for every bucket; it cannot go with "
                         "bucket_cap_mb_list. Pass one of them.")
    return True


def resolve_bucket_caps(bucket_cap_mb: float | None, bucket_cap_mb_list: Sequence[float] | None,
                        first_bucket_cap_mb: float | None) -> tuple[float | tuple[float, ...], float]:
    """Return (``bucket_cap_mb`` for ``plan_buckets``, first bucket's cap) with torch's defaults.

    As in torch, the small default first bucket (1 MiB) applies only when no cap was given: an
    explicit ``bucket_cap_mb`` caps the first bucket too, and ``bucket_cap_mb_list`` gives each
    bucket its own cap (the last one repeats). ``first_bucket_cap_mb`` overrides the first cap.
    """
    if bucket_cap_mb_list is not None:
        caps = tuple(float(c) for c in bucket_cap_mb_list)
        if not caps or min(caps) <= 0:
            raise ValueError(f"bucket_cap_mb_list must be a non-empty list of positive sizes in MiB, "
                             f"got {bucket_cap_mb_list!r}")
        first = caps[0] if first_bucket_cap_mb is None else first_bucket_cap_mb
        return caps, first
    if bucket_cap_mb is None:
        first = DEFAULT_FIRST_BUCKET_CAP_MB if first_bucket_cap_mb is None else first_bucket_cap_mb
        return DEFAULT_BUCKET_CAP_MB, first
    return bucket_cap_mb, bucket_cap_mb if first_bucket_cap_mb is None else first_bucket_cap_mb


def resolve_device_ids(device_ids: Any, output_device: Any,
                       params: Sequence[torch.Tensor]) -> tuple[list[int] | None, int | None]:
    """Return torch's (device_ids, output_device): None for CPU and multi-device modules."""
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError("device_ids can only be None or contain a single element.")
    devices = {p.device for p in params}
    if not device_ids or len(devices) > 1 or next(iter(devices)).type == "cpu":
        if device_ids or output_device:
            raise ValueError(
                "DistributedDataParallel device_ids and output_device arguments only work with "
                "single-device/multiple-device GPU modules or CPU modules, but got device_ids "
                f"{device_ids}, output_device {output_device}, and module parameters {devices}. "
                "For a CPU or multi-device module leave both None."
            )
        return None, None
    ids = [device_index(d) for d in device_ids]
    return ids, device_index(output_device if output_device is not None else device_ids[0])


__all__ = ["DEFAULT_BUCKET_CAP_MB", "DEFAULT_FIRST_BUCKET_CAP_MB", "Resolved", "resolve", "resolve_auto_cap",
           "resolve_bucket_caps", "resolve_buffer_sync", "resolve_device_ids", "resolve_group", "resolve_timeout"]
