"""The ``DistributedDataParallel`` module wrapper: construction checks, broadcasts, ``no_sync``."""
from __future__ import annotations

import contextlib
import hashlib
import weakref
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .comm import CommHook
from .control import SyncError, bounded_wait
from .reducer import Reducer


# id -> parameter, for parameters owned by a live gradsync wrapper (a WeakSet would compare tensors)
_WRAPPED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def resolve_timeout(timeout: timedelta | float | None, group: dist.ProcessGroup,
                    device: torch.device) -> timedelta:
    """Return ``timeout`` as a timedelta; None means the process group's own timeout."""
    if timeout is None:
        try:
            return group._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            return dist.default_pg_timeout
    if isinstance(timeout, (int, float)):
        timeout = timedelta(seconds=timeout)
    if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be a positive number of seconds or a timedelta, got {timeout!r}")
    return timeout


def describe(module: nn.Module) -> list[tuple]:
    """Return what must agree across ranks: (kind, name, shape, dtype, requires_grad) per tensor."""
    rows = [("parameter", n, tuple(p.shape), str(p.dtype), p.requires_grad)
            for n, p in module.named_parameters()]
    rows += [("buffer", n, tuple(b.shape), str(b.dtype), False) for n, b in module.named_buffers()]
    return rows


def verify_same_model(module: nn.Module, group: dist.ProcessGroup, timeout: timedelta,
                      device: torch.device | None = None) -> None:
    """Raise on every rank if any rank's parameters or buffers differ from rank 0's."""
    mine = describe(module)
    # compare digests with a bounded collective; gather the details only on a mismatch
    digest = int.from_bytes(hashlib.sha256(repr(mine).encode()).digest()[:7], "little")
    digests = torch.zeros(dist.get_world_size(group), dtype=torch.int64, device=device)
    digests[dist.get_rank(group)] = digest
    try:
        bounded_wait(dist.all_reduce(digests, group=group, async_op=True), timeout)
    except Exception as exc:
        raise SyncError(
            f"gradsync: rank {dist.get_rank(group)} waited for the other ranks to construct "
            f"DistributedDataParallel and they did not within {timeout.total_seconds():g}s: {exc}. "
            "Likely cause: another rank died, raised before wrapping its model, or wraps a "
            "different number of models."
        ) from exc
    if len(set(digests.tolist())) == 1:
        return
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    reference = everyone[0]
    problems = [f"rank {r}: {_first_difference(reference, rows)}"
                for r, rows in enumerate(everyone) if rows != reference]
    if problems:
        raise ValueError(
            "gradsync: the model differs across ranks (compared with rank 0): " + "; ".join(problems)
            + ". Build the same model on every rank before wrapping it."
        )


def _first_difference(reference: list[tuple], rows: list[tuple]) -> str:
    for ref, row in zip(reference, rows):
        if ref != row:
            if ref[1] != row[1]:
                return f"has {row[0]} '{row[1]}' where rank 0 has {ref[0]} '{ref[1]}'"
            fields = ("shape", "dtype", "requires_grad")
            diffs = [f"{f} {b} (rank 0: {a})" for f, a, b in zip(fields, ref[2:], row[2:]) if a != b]
            return f"{row[0]} '{row[1]}' has " + ", ".join(diffs)
    count = lambda rs, kind: sum(r[0] == kind for r in rs)  # noqa: E731
    return (f"{count(rows, 'parameter')} parameters and {count(rows, 'buffer')} buffers, rank 0 has "
            f"{count(reference, 'parameter')} and {count(reference, 'buffer')}")


def broadcast_coalesced(tensors: list[torch.Tensor], group: dist.ProcessGroup, wait,
                        src_rank: int = 0) -> None:
    """Overwrite ``tensors`` with group rank ``src_rank``'s values, one collective per dtype and device."""
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    src = dist.get_global_rank(group, src_rank)
    for same in by_kind.values():
        flat = torch.cat([t.detach().reshape(-1) for t in same])
        wait(dist.broadcast(flat, src=src, group=group, async_op=True))
        with torch.no_grad():
            for t, part in zip(same, flat.split([t.numel() for t in same])):
                t.copy_(part.view_as(t))


def check_wrappable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Return the trainable (name, parameter) pairs, or raise if ``module`` cannot be wrapped."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("gradsync: torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group() before wrapping the model")
    if isinstance(module, (DistributedDataParallel, nn.parallel.DistributedDataParallel)):
        raise ValueError(f"gradsync: the module is already wrapped in {type(module).__module__}."
                         f"{type(module).__name__}; wrap the inner module once")
    named = list(module.named_parameters())
    for name, p in named:
        if isinstance(p, nn.parameter.UninitializedParameter):
            raise ValueError(f"gradsync: parameter '{name}' is lazy (uninitialized). Run one forward "
                             "pass on a sample batch to materialize it before wrapping the model")
        if _WRAPPED.get(id(p)) is p:
            raise ValueError(f"gradsync: parameter '{name}' already belongs to a gradsync wrapper; "
                             "a module (or one of its submodules) must be wrapped only once")
    trainable = [(n, p) for n, p in named if p.requires_grad]
    if not trainable:
        raise ValueError("gradsync: the module has no parameters that require gradients; "
                         "there is nothing to synchronize")
    return trainable


class DistributedDataParallel(nn.Module):
    """Data parallelism with bucketed, backward-overlapped gradient averaging.

    A drop-in for ``torch.nn.parallel.DistributedDataParallel``: same constructor keywords, same
    ``no_sync()``, comm hooks and ``module.``-prefixed state dict. ``timeout`` bounds every wait
    on a collective (default: the process group's timeout). ``check_finite=True`` checks each
    reduced bucket for NaN/inf and raises ``FloatingPointError`` naming the parameters before the
    gradients are written back. ``join()`` finishes an epoch whose ranks have uneven inputs.
    """

    reducer_class = Reducer  # subclasses swap in another reduction strategy (e.g. sharded)

    def __init__(self, module: nn.Module, *, process_group: dist.ProcessGroup | None = None,
                 broadcast_buffers: bool = True, bucket_cap_mb: float = 25.0,
                 first_bucket_cap_mb: float = 1.0, find_unused_parameters: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 timeout: timedelta | float | None = None, device_ids: Any = None,
                 output_device: Any = None, dim: int = 0, check_finite: bool = False):
        super().__init__()
        trainable = check_wrappable(module)
        self.module = module
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.broadcast_buffers = broadcast_buffers
        self.require_backward_grad_sync = True
        self.device_ids, self.output_device, self.dim = device_ids, output_device, dim
        self.timeout = resolve_timeout(timeout, self.process_group, trainable[0][1].device)
        self.world_size = dist.get_world_size(self.process_group)

        verify_same_model(module, self.process_group, self.timeout, trainable[0][1].device)
        names = [n for n, _ in trainable]
        params = [p for _, p in trainable]
        self.reducer = self.reducer_class(
            params, names, self.process_group, should_sync=self._backward_syncs,
            bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph,
            timeout=self.timeout)
        self.reducer.check_finite = check_finite
        self._join: Any = None  # the active gradsync.core.join.Join while inside model.join()
        if self.world_size > 1:
            broadcast_coalesced(list(module.parameters()) + list(module.buffers()),
                                self.process_group, self._wait)
        self._param_snapshot = [(p, p.requires_grad) for p in module.parameters()]
        _WRAPPED.update((id(p), p) for p in params)

    def _wait(self, work: dist.Work) -> None:
        self.reducer.wait(work, "a broadcast of parameters or buffers")

    def _broadcast(self, tensors: list[torch.Tensor], src_rank: int = 0) -> None:
        broadcast_coalesced(tensors, self.process_group, self._wait, src_rank)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.reducer.prepare_for_forward()
        self._check_parameters_unchanged()
        self._check_group()
        src = self._join.before_forward() if self._join is not None else 0
        if self._will_broadcast_buffers():
            buffers = list(self.module.buffers())
            if buffers:
                broadcast_coalesced(buffers, self.process_group, self._wait, src)
        output = self.module(*args, **kwargs)
        if torch.is_grad_enabled():
            self.reducer.prepare_for_backward(output, self.module.training, self.require_backward_grad_sync)
        return output

    def _will_broadcast_buffers(self) -> bool:
        # Every training forward starts from rank 0's buffers, no_sync micro-steps included; eval
        # and no_grad forwards skip the broadcast, so rank-local evaluation needs no collective.
        return (self.broadcast_buffers and self.world_size > 1 and self.module.training
                and torch.is_grad_enabled())

    def _check_group(self) -> None:
        try:
            ok = dist.is_initialized() and dist.get_rank(self.process_group) >= 0
        except (ValueError, RuntimeError):
            ok = False
        if not ok:
            raise RuntimeError(
                "gradsync: the model's process group was destroyed (or torch.distributed was shut "
                "down); DistributedDataParallel cannot communicate any more. Call model.module(...) "
                "for local inference, or init_process_group() again and wrap a new model."
            )

    def _backward_syncs(self) -> bool:
        sync = self.require_backward_grad_sync
        if self._join is not None:
            self._join.check_backward(sync)
        return sync

    def join(self, enable: bool = True):
        """Return a context manager for uneven inputs: wrap the training loop in ``with model.join():``.

        A rank whose loop ends early keeps taking part in the others' collectives with zero
        gradients until every rank is done (gradients divide by the full world size, like
        torch's default); then parameters and buffers are copied from a rank that ran longest.
        Inside it, decide ``no_sync`` before each forward, and follow each forward made with
        gradients enabled by exactly one backward.
        """
        from .join import Join
        return Join(self, enable)

    def _check_parameters_unchanged(self) -> None:
        snapshot = self._param_snapshot
        current = list(self.module.parameters())
        if len(current) == len(snapshot) and all(
                p is q and p.requires_grad == rg for p, (q, rg) in zip(current, snapshot)):
            return
        raise RuntimeError(
            "gradsync: the module's parameters changed after it was wrapped (a parameter was added, "
            "removed or replaced, or its requires_grad changed). gradsync only synchronizes the "
            "parameters it saw at construction; make such changes before wrapping, then wrap again."
        )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, without communication, inside this context."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Use ``hook(state, bucket) -> Future[Tensor]`` instead of the default averaging all-reduce."""
        if not callable(hook):
            raise TypeError(f"gradsync: the communication hook must be callable, got {type(hook).__name__}")
        if self.reducer.comm_hook is not None:
            raise RuntimeError("gradsync: register_comm_hook can only be called once")
        if self.reducer.backward_count > 0:
            raise RuntimeError("gradsync: register_comm_hook must be called before the first backward")
        self.reducer.comm_hook, self.reducer.comm_state = hook, state

    def enable_comm_trace(self) -> list[dict]:
        """Start recording a per-bucket timeline of every synced backward; return the record list."""
        if self.reducer.trace is None:
            self.reducer.trace = []
        return self.reducer.trace

    @property
    def comm_trace(self) -> list[dict] | None:
        return self.reducer.trace

    def scale_grads_(self, factor: float) -> None:
        """Multiply every synchronized gradient by ``factor`` (used by the accumulator)."""
        grads = [p.grad for p in self.reducer.params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor)

    def grad_state_dict(self) -> dict[str, Any]:
        """Return this rank's gradients and the bucket layout: save both at every checkpoint.

        Mid-window, the accumulated micro-steps are training state; the layout (re-planned after
        the first synced backward) decides the summation order of every later reduction.
        """
        reducer = self.reducer
        order = reducer.plan_order
        return {"gradients": {name: p.grad.detach().clone() for name, p in zip(reducer.names, reducer.params)
                              if p.grad is not None},
                "bucket_order": None if order is None else [reducer.names[i] for i in order]}

    def load_grad_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``grad_state_dict()`` of the same rank, before the first backward."""
        if set(state) != {"gradients", "bucket_order"}:
            raise KeyError("gradsync: expected a dict from model.grad_state_dict() with keys 'gradients' "
                           f"and 'bucket_order', got keys {sorted(state)[:5]}")
        reducer = self.reducer
        grads, order = state["gradients"], state["bucket_order"]
        unknown = set(grads) - set(reducer.names)
        if order is not None:
            unknown |= set(order) - set(reducer.names)
        if unknown or (order is not None and len(order) != len(reducer.names)):
            raise KeyError("gradsync: the gradient state does not match this model's parameters "
                           f"(unknown: {sorted(unknown)[:5]}); load it into the model it was saved from")
        if order is not None:
            if reducer.backward_count:
                raise RuntimeError("gradsync: load_grad_state_dict() must come before the first backward")
            index = {name: i for i, name in enumerate(reducer.names)}
            reducer.load_plan_order([index[name] for name in order])
        for name, p in zip(reducer.names, reducer.params):
            p.grad = grads[name].detach().clone().to(p.device) if name in grads else None

DDP = DistributedDataParallel
__all__ = ["DistributedDataParallel", "DDP", "SyncError"]
