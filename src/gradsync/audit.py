"""``gradsync.audit``: every rank computes the gradient of the same micro-batch, and the ranks compare.

``check_replicas`` compares what every rank must hold after the reduction (parameters, reduced
gradients). A fault that makes one rank compute a wrong local gradient (a faulty core, a GPU's
arithmetic) is averaged into every rank alike: the replicas still agree, and that check cannot see it.
An audit can: at a point the ranks choose together, each runs the same micro-batch (rank ``src``'s,
sent to all) through the same parameters with the same random numbers, and the fingerprints of the
resulting gradients (``engine/replicas.py``'s exact word sums) must be equal bit for bit. It leaves
no trace in training: the gradients go to ``torch.autograd.grad`` (no ``.grad``, none of the reducer's
hooks), the buffers and the random number generators are put back. Its price is one forward and
backward and four small collectives (the header, the micro-batch in two broadcasts, the fingerprints) per call,
so it is sampled: e.g. once every few hundred steps.
"""
from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ._torch import module_slot_dicts
from .engine.collectives import broadcast_bytes, deserialized, serialized
from .engine.control import AUDIT
from .engine.errors import PeerFailure, ReplicaMismatchError
from .engine.replicas import disagreeing, fingerprint, gathered, in_the_job, who

_AUDITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> audits it ran: the default seed


@dataclass(frozen=True)
class AuditReport:
    """``compared``: gradients compared per rank (0 on one rank); ``complete``: False when a member of an
    elastic job left during it (nothing was compared; the next synced backward re-forms)."""

    compared: int
    seconds: float
    complete: bool = True


def audit(model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch: Any, *, src: int = 0,
          seed: int | None = None) -> AuditReport:
    """Compute the gradient of rank ``src``'s ``batch`` on every rank and raise ``ReplicaMismatchError`` on
    every rank unless all got the same bits, naming the rank(s) that disagree and the parameters.

    Call it on every rank at the same point, between backwards (e.g. right after ``optimizer.step()``):
    it exchanges a phase header first, so a rank that is elsewhere makes every rank raise instead of
    pairing collectives wrongly. ``loss_fn(model.module, batch)`` returns the scalar loss; only rank
    ``src``'s ``batch`` is used (the others may pass None). ``seed`` seeds every rank's random numbers
    alike for its length (default: the number of audits this model ran). The gradients must be
    deterministic (always on CPU; on a GPU with ``torch.use_deterministic_algorithms(True)``)."""
    start = time.perf_counter()
    reducer = getattr(model, "reducer", None)
    if reducer is None or not hasattr(model, "module"):
        raise TypeError(f"gradsync.audit: expected a gradsync DistributedDataParallel or ShardedDataParallel, "
                        f"got {type(model).__name__}")
    if reducer.it.in_backward:
        raise RuntimeError("gradsync.audit: called inside a backward; call it between backwards, on every rank")
    if getattr(model, "join_state", None) is not None:  # a joined rank shadows backwards, not audits
        raise RuntimeError("gradsync.audit: called inside model.join(); call it outside the join, on every rank")
    plane, attached = reducer.plane, reducer.attached
    if plane.world_size == 1:
        return AuditReport(0, time.perf_counter() - start)
    if attached is not None and attached.broken is not None:  # the next synced backward re-forms first
        return AuditReport(0, time.perf_counter() - start, complete=False)
    count = _AUDITS.get(model, 0)
    _AUDITS[model] = count + 1
    try:
        plane.exchange_header(AUDIT)  # a rank in a forward's broadcast or a synced backward: all raise here
        batch = _broadcast(batch, src, reducer)
        gathers = getattr(reducer.store, "gathers", None)
        if gathers is not None and gathers.active:  # ShardedOptimizer(prefetch=True): the parameters first
            gathers.finish()
        params = reducer.params
        grads = _gradients(model.module, loss_fn, batch, params, count if seed is None else seed)
        none = torch.zeros((), dtype=torch.int64, device=params[0].device)  # a missing gradient's fingerprint
        mine = torch.cat([torch.stack([fingerprint([t]) if t is not None else none for t in [*params, *grads]]),
                          torch.tensor([g is not None for g in grads], dtype=torch.int64, device=none.device)])
        table = gathered(mine, plane, "the audit's fingerprints")
    except PeerFailure as exc:  # an elastic member left: stop using the group; the next synced backward re-forms
        attached.lose_group(exc)
        return AuditReport(0, time.perf_counter() - start, complete=False)
    n, active = len(params), plane.active()
    by_rank = {r: table[r].tolist() for r in active}
    differ, ranks = disagreeing({r: v[:n] for r, v in by_rank.items()}, n)
    if differ:
        raise ReplicaMismatchError(_text(ranks, active, differ, reducer.names, "hold different parameters")
                                   + in_the_job(sorted(ranks), plane.group))
    differ, ranks = disagreeing({r: [(v[n + i], v[2 * n + i]) for i in range(n)] for r, v in by_rank.items()}, n)
    if differ:
        raise ReplicaMismatchError(_text(ranks, active, differ, reducer.names, "computed different gradients from "
                                         "the same micro-batch and parameters") + in_the_job(sorted(ranks), plane.group))
    return AuditReport(n, time.perf_counter() - start)


def _broadcast(batch: Any, src: int, reducer: Any) -> Any:
    """Rank ``src``'s ``batch`` on every rank, its tensors on the device they had there (or the model's)."""
    plane = reducer.plane
    blob = broadcast_bytes(serialized(batch) if plane.rank == src else None, dist.get_global_rank(plane.group, src),
                           plane.group, lambda work: reducer.wait(work, "the audit's micro-batch"))
    if plane.rank == src:
        return batch
    device = reducer.device  # a tensor on rank src's GPU lands on this rank's
    gpus = {f"cuda:{k}": str(device) for k in range(torch.cuda.device_count())} if device.type == "cuda" else None
    return deserialized(blob, map_location=gpus)


def _gradients(module: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch: Any,
               params: list[torch.Tensor], seed: int) -> tuple[torch.Tensor | None, ...]:
    """``loss_fn``'s gradients with respect to ``params``; the buffers and random state as they were."""
    buffers = [(name, b, b.detach().clone()) for name, b in module.named_buffers()]
    devices = [params[0].device.index or 0] if params and params[0].device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            torch.manual_seed(seed)
            loss = loss_fn(module, batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
                raise TypeError("gradsync.audit: loss_fn(module, batch) must return a scalar tensor that requires "
                                f"grad (the loss of a forward of module), got {type(loss).__name__}"
                                + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""))
            return torch.autograd.grad(loss.reshape(()), params, allow_unused=True)
    finally:
        with torch.no_grad():
            for name, old, saved in buffers:
                owner, _, leaf = name.rpartition(".")
                slots = module_slot_dicts(module.get_submodule(owner))[1]
                if slots.get(leaf) is not old:  # rebound by the forward: bind the old one again
                    slots[leaf] = old
                old.copy_(saved)


def _text(ranks: list[int], active: list[int], differ: list[int], names: list[str], what: str) -> str:
    shown = ", ".join(f"'{names[i]}'" for i in differ[:8]) + (f" and {len(differ) - 8} more" if len(differ) > 8 else "")
    return (f"gradsync.audit: {who(sorted(ranks), active)}: they {what} ({shown}). The same micro-batch through the same "
            "parameters must give the same bits on every rank; a silent fault in that rank's arithmetic (a CPU "
            "core, a GPU) or memory did not. On a GPU, a kernel that is not deterministic gives the same symptom: "
            "run audits under torch.use_deterministic_algorithms(True). Check or replace the named rank's host, "
            "then resume every rank from a checkpoint saved before the last audit that passed.")


__all__ = ["AuditReport", "audit"]
