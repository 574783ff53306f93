"""What the Lightning and Fabric strategies share: option checks, backward-sync control, sharded optimizers."""
from __future__ import annotations

import difflib
import inspect
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from ._lightning import BackwardSyncControl

from .. import DistributedDataParallel, ShardedDataParallel, ShardedGradScaler, ShardedOptimizer
from ..engine.config import resolve_reduce_dtype

# Set by the strategy itself (Lightning passes device_ids; the module is the LightningModule).
_SET_BY_STRATEGY = {"module": "the model Lightning wraps", "device_ids": "the Trainer's/Fabric's devices"}
_RENAMED = {"sync_timeout": "timeout"}  # Lightning's own `timeout` is the process group's


def _keywords(cls: type) -> list[str]:
    return [n for n, p in inspect.signature(cls).parameters.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


DDP_OPTIONS = [n for n in _keywords(DistributedDataParallel) if n not in _SET_BY_STRATEGY and n != "timeout"]
SHARDED_ONLY = [n for n in _keywords(ShardedDataParallel) if n != "module"]


def wrapper_options(owner: str, options: dict[str, Any], sharded: bool,
                    lightning_args: list[str]) -> dict[str, Any]:
    """Check the strategy's extra keyword arguments; return the wrapper's keyword arguments.

    Unknown names raise ``TypeError`` at once, in the process that builds the strategy (before any
    rank starts), naming the closest option and listing the valid ones.
    """
    valid = DDP_OPTIONS + list(_RENAMED) + (SHARDED_ONLY if sharded else [])
    out: dict[str, Any] = {}
    for name, value in options.items():
        if name in valid:
            if name == "reduce_dtype":
                resolve_reduce_dtype(value, [])  # a bad dtype fails here, not later on every rank
            out[_RENAMED.get(name, name)] = value
            continue
        if name in _SET_BY_STRATEGY:
            raise TypeError(f"{owner}: '{name}' is set by the strategy ({_SET_BY_STRATEGY[name]}); do not pass it")
        if name in SHARDED_ONLY:
            raise TypeError(f"{owner}: '{name}' is an option of gradsync.ShardedDataParallel; use "
                            f"strategy='gradsync_sharded' or {owner}(sharded=True, {name}=...)")
        close = difflib.get_close_matches(name, valid + lightning_args, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise TypeError(
            f"{owner}: unknown option '{name}'{hint}. gradsync's options: {', '.join(valid)}. "
            f"Lightning's strategy arguments: {', '.join(lightning_args)}. "
            "(`timeout` is Lightning's process-group timeout; gradsync's bound on each wait is `sync_timeout`.)")
    return out


def take_options(strategy: Any, base: type, kwargs: dict[str, Any], sharded: bool) -> dict[str, Any]:
    """Remove from ``kwargs`` what is not an argument of Lightning's ``base`` strategy; return it
    checked as gradsync's wrapper options (a ``TypeError`` names an unknown one)."""
    owner = f"gradsync.lightning.{type(strategy).__name__}"
    named = lightning_arguments(base)
    options = {k: kwargs.pop(k) for k in list(kwargs) if k not in named}
    return wrapper_options(owner, options, bool(sharded), named + ["sharded"])


def register_names(registry: Any, cls: type) -> None:
    """Register ``cls`` as ``"gradsync"`` and ``"gradsync_sharded"`` in a Lightning or Fabric registry."""
    registry.register("gradsync", cls, description="DDP with gradsync's DistributedDataParallel", override=True)
    registry.register("gradsync_sharded", cls, override=True, sharded=True,
                      description="ZeRO-2 style: gradsync's ShardedDataParallel and ShardedOptimizer")


def lightning_arguments(cls: type) -> list[str]:
    """The named arguments of a Lightning strategy's constructor (everything else goes to the wrapper)."""
    return [n for n in _keywords(cls) if n != "self"]


def wrap(module: torch.nn.Module, sharded: bool, device_ids: list[int] | None,
         options: dict[str, Any]) -> DistributedDataParallel:
    """Build gradsync's wrapper (``ShardedDataParallel`` when sharded) around ``module``."""
    cls = ShardedDataParallel if sharded else DistributedDataParallel
    return cls(module, device_ids=device_ids, **options)


class GradsyncBackwardSyncControl(BackwardSyncControl):
    """``no_backward_sync`` through gradsync's ``no_sync()`` (read at the backward, too)."""

    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        if not isinstance(module, DistributedDataParallel):
            raise TypeError("gradsync: blocking backward sync needs a module wrapped in gradsync's "
                            f"DistributedDataParallel by the strategy; got {type(module).__name__}")
        return module.no_sync()


def shard_optimizer(model: ShardedDataParallel, optimizer: torch.optim.Optimizer) -> ShardedOptimizer:
    """The same optimizer class and parameter groups, stepping this rank's shard of ``model``."""
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer
    if optimizer.state:
        raise RuntimeError("gradsync: the optimizer already has state; a gradsync_sharded strategy shards "
                           "optimizers before their first step")
    cls = type(optimizer)
    accepted = set(inspect.signature(cls).parameters)
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    groups = [dict(g) for g in optimizer.param_groups]
    return ShardedOptimizer(model, cls, param_groups=groups, **defaults)


def shard_scaler(precision: Any) -> None:
    """fp16 loss scaling on shards: the precision plugin's torch GradScaler becomes a ShardedGradScaler, same state
    (torch's finds no gradient on a ShardedOptimizer's pieces)."""
    old = getattr(precision, "scaler", None)
    if isinstance(old, torch.amp.GradScaler) and not isinstance(old, ShardedGradScaler):
        precision.scaler = ShardedGradScaler(precision.device, enabled=old.is_enabled())
        precision.scaler.load_state_dict(old.state_dict())


def rebind_scheduler(scheduler: Any, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
    """Point a learning-rate scheduler built on ``old`` at ``new`` (same groups, same options)."""
    if scheduler is not None and getattr(scheduler, "optimizer", None) is old:
        scheduler.optimizer = new
