"""The ``DistributedDataParallel`` module wrapper: forward, ``no_sync``, comm hooks, join, pickling.

Construction checks and torch's constructor options are resolved in ``construct.py``.
"""
from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Joinable, JoinHook

from .._torch import TorchDDP, foreach_mul_, to_kwargs
from ..engine.comm import CommHook
from ..engine.autocap import check_auto_cap_hook_state
from .compile import active_ddp, bucket_bytes_caps, skip_wrapper_frames
from .construct import (broadcast_coalesced, check_comm_hook, check_wrappable, claim, resolve_auto_cap, resolve_bucket_caps, resolve_buffer_sync, resolve_device_ids, resolve_group, resolve_timeout, verify_same_model)
from ..engine.control import SyncError, bounded_wait
from .delay import DelayedAllReduce
from ..engine.header import FORWARD
from .join import DDPJoinHook, Join
from ..engine.config import ReducerConfig, resolve_reduce_dtype
from .grad_state import grad_state, load_grad_state
from ..engine.reducer import Reducer
from ..engine import protocol as membership
from ..engine import replay as standin
from .snapshot import module_tensors, parameters_swapped, snapshot
from ..engine.replay import Mark
from ..engine.telemetry import ReportMethods
from .torch_extras import TorchDDPExtras


class DistributedDataParallel(TorchDDPExtras, ReportMethods, nn.Module, Joinable):
    """Data parallelism with bucketed, backward-overlapped gradient averaging.

    A drop-in for ``torch.nn.parallel.DistributedDataParallel`` (torch 2.13): the same constructor
    arguments with torch's meaning, ``no_sync()``, comm hooks, ``join()`` (a ``Joinable``, so
    ``torch.distributed.algorithms.Join([model, optimizer])`` works too), pickling, and a
    ``module.``-prefixed state dict. Buckets follow torch's caps: 25 MiB, and a 1 MiB first bucket
    unless ``bucket_cap_mb`` (or ``bucket_cap_mb_list``) is given. gradsync's own keywords:
    ``first_bucket_cap_mb`` caps the first bucket explicitly; ``timeout`` bounds every wait on a
    collective (default: the process group's timeout); ``check_finite=True`` checks each reduced
    bucket for NaN/inf and raises ``FloatingPointError`` naming the parameters before the gradients
    are written back. ``reduce_dtype`` (e.g. ``torch.float32`` for bf16 parameters) accumulates
    every micro-step's gradient and reduces in that dtype: after a synced backward
    ``param.main_grad`` is the average (a view into the bucket) and ``.grad`` its copy in the
    parameter's dtype (``engine/main_grad.py``).

    ``skip_all_reduce_unused_params=True`` (with ``find_unused_parameters=True`` or ``static_graph``)
    launches no collective for a bucket whose parameters no rank used in the previous synced backward,
    the same buckets on every rank (``engine/unused.py``). Accepted for compatibility, with no effect:
    ``batched_grad_copy`` (a CUDA kernel-launch optimization), ``check_reduction`` (deprecated in
    torch too). ``broadcast_buffers`` is deprecated as in torch 2.13: ``broadcast_buffers=False``
    also keeps buffers out of the initial sync, ``forward_sync_buffers=False`` does not.
    ``delay_all_reduce_named_params`` parameters are averaged when a synchronizing backward that
    reached ``param_to_hook_all_reduce`` ends. ``mixed_precision`` is not supported.
    """

    sharded = False  # ShardedDataParallel: gradient shards (refusals in config.py, parts in make_reducer)

    def __init__(self, module: nn.Module, device_ids: Sequence[int | torch.device] | None = None,
                 output_device: int | torch.device | None = None, dim: int = 0,
                 broadcast_buffers: bool | None = None, init_sync: bool = True,
                 process_group: dist.ProcessGroup | None = None, bucket_cap_mb: float | str | None = None,
                 find_unused_parameters: bool = False, check_reduction: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 delay_all_reduce_named_params: Sequence[tuple[str, nn.Parameter]] | None = None,
                 param_to_hook_all_reduce: nn.Parameter | None = None, mixed_precision: Any = None,
                 device_mesh: Any = None, skip_all_reduce_unused_params: bool = False,
                 bucket_cap_mb_list: Sequence[float] | None = None, batched_grad_copy: bool = False,
                 forward_sync_buffers: bool | None = None, *, first_bucket_cap_mb: float | None = None,
                 timeout: timedelta | float | None = None, check_finite: bool = False,
                 reduce_dtype: torch.dtype | None = None, straggler_warning: bool = True):
        super().__init__()
        Joinable.__init__(self)
        if mixed_precision is not None:
            raise NotImplementedError("gradsync: mixed_precision (torch's experimental _MixedPrecision) is "
                                      "not supported; keep parameters in one dtype or use torch.autocast")
        if (delay_all_reduce_named_params is None) != (param_to_hook_all_reduce is None):
            raise ValueError("delay_all_reduce_named_params and param_to_hook_all_reduce "
                             "need to be set at the same time.")
        if check_reduction:
            warnings.warn("The `check_reduction` argument in `DistributedDataParallel` module is "
                          "deprecated. Please avoid using it.", FutureWarning, stacklevel=2)
        self.process_group = resolve_group(process_group, device_mesh)
        if device_mesh is not None:
            self.device_mesh = device_mesh
        trainable = check_wrappable(module, (DistributedDataParallel, TorchDDP))
        delayed = dict(delay_all_reduce_named_params or ())
        reduced = [n for n, _ in trainable if n not in delayed]
        if not reduced:
            raise NotImplementedError("gradsync: delay_all_reduce_named_params names every trainable "
                                      "parameter; leave at least one to the reducer")
        self.device_ids, self.output_device = resolve_device_ids(device_ids, output_device,
                                                                 [p for _, p in trainable])
        self.module = module
        self.dim = dim
        self.forward_sync_buffers, init_sync_buffers = resolve_buffer_sync(broadcast_buffers,
                                                                           forward_sync_buffers)
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True  # False: the next forwards do not sync buffers
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.batched_grad_copy = batched_grad_copy
        self.device = trainable[0][1].device
        self.world_size = dist.get_world_size(self.process_group)
        auto = resolve_auto_cap(bucket_cap_mb, bucket_cap_mb_list)
        caps, first_cap = resolve_bucket_caps(None if auto else bucket_cap_mb, bucket_cap_mb_list,
                                              first_bucket_cap_mb)
        # every refusal comes here, before the first collective (verify_same_model)
        config = ReducerConfig(
            bucket_cap_mb=caps, first_bucket_cap_mb=first_cap, auto_bucket_cap=auto,
            user_first_bucket_cap_mb=first_bucket_cap_mb, find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph,
            skip_all_reduce_unused_params=bool(skip_all_reduce_unused_params),
            timeout=resolve_timeout(timeout, self.process_group, self.device),
            reduce_dtype=resolve_reduce_dtype(reduce_dtype, [p for _, p in trainable]), check_finite=check_finite,
            sharded=self.sharded, straggler_warning=bool(straggler_warning), wrapper_name=type(self).__name__)
        skip_wrapper_frames()
        self._reduced_names = reduced
        self._delayed_names = list(delayed)
        self._delay_trigger = param_to_hook_all_reduce
        if init_sync:  # before the reducer allocates its buckets: peak memory is one model copy less
            verify_same_model(module, self.process_group, config.timeout, self.device)
            if self.world_size > 1:
                self._broadcast(list(module.parameters())
                                + (list(module.buffers()) if init_sync_buffers else []), timeout=config.timeout)
        self._param_snapshot = snapshot(module)
        self._build_reducer(config)
        follows = membership.current()
        if follows is not None and process_group is None and device_mesh is None:
            if skip_all_reduce_unused_params:  # a replica that joins has not seen which buckets the others skip
                raise ValueError("gradsync: skip_all_reduce_unused_params=True is not supported with "
                                 "gradsync.elastic membership; leave it False")
            membership.follow(self, follows)  # elastic/membership.py: re-form after a member leaves

    def make_reducer(self, params: list[nn.Parameter], names: list[str], config: ReducerConfig) -> Reducer:
        """Build the reducer over ``params``; a subclass plugs in another store and launcher (sharded)."""
        return Reducer(params, names, self.process_group, config, should_sync=should_sync_of(self))

    def _build_reducer(self, config: ReducerConfig) -> None:
        named = dict(self.module.named_parameters())
        params = [named[n] for n in self._reduced_names]
        self.reducer = self.make_reducer(params, list(self._reduced_names), config)
        weakref.finalize(self, self.reducer.remove_hooks)  # a deleted wrapper leaves no hooks behind
        self._join: DDPJoinHook | None = None  # set by join_hook() while a join is configured
        self._delayed = None
        if self._delayed_names:
            self._delayed = DelayedAllReduce(self, [named[n] for n in self._delayed_names], self._delay_trigger)
            weakref.finalize(self, self._delayed.remove)
        claim(params + (self._delayed.params if self._delayed else []), self)

    def _wait(self, work: dist.Work, what: str = "a broadcast of parameters or buffers",
              timeout: timedelta | None = None) -> None:
        reducer = self.__dict__.get("reducer")
        if reducer is not None:
            reducer.wait(work, what)
            return
        try:
            bounded_wait(work, timeout)
        except Exception as exc:
            raise SyncError(
                f"gradsync: rank {dist.get_rank(self.process_group)} waited for the initial broadcast of "
                f"parameters and buffers and it failed or did not finish within "
                f"{timeout.total_seconds():g}s: {exc}. Likely cause: another rank died or raised "
                "while wrapping its model, or wraps a different number of models."
            ) from exc

    def _broadcast(self, tensors: list[torch.Tensor], src_rank: int = 0, timeout: timedelta | None = None) -> None:
        wait = self._wait if timeout is None else lambda work: self._wait(work, timeout=timeout)
        broadcast_coalesced(tensors, self.process_group, wait, src_rank)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if getattr(self, "_superseded", False):
            raise RuntimeError(
                "gradsync: this DistributedDataParallel no longer synchronizes: its module (or part "
                "of it) was wrapped again by a newer DistributedDataParallel, which now owns the "
                "parameters. Use the newer wrapper.")
        self.reducer.prepare_for_forward()
        if self._delayed is not None:
            self._delayed.prepare_for_forward()
        current, module_buffers = module_tensors(self.module)  # one walk for both (snapshot.py)
        swapped = parameters_swapped(self.module, self._param_snapshot, self.reducer.params, current)
        self._check_group()
        src = self._join.before_forward() if self._join_config.enable and self._join is not None else 0
        buffers = module_buffers if self.will_broadcast_buffers() else []
        if buffers and self.reducer.broken is None:
            try:
                self.reducer.plane.exchange_header(FORWARD)  # a rank still in its backward must not meet a broadcast
                self._broadcast(buffers, src)
            except membership.PeerFailure as exc:
                if self.reducer.membership is None:
                    raise
                self.reducer.break_group(exc)  # local buffers until the window's synced backward re-forms
        if self.device_ids:  # a single-GPU module: inputs move to its device, as in torch
            inputs, kwargs = to_kwargs(inputs, kwargs, torch.device(self.device.type, self.device_ids[0]))
        with active_ddp(self, bucket_bytes_caps(*self.reducer.store.caps)[1]):  # compiled frames split at bucket boundaries
            output = self.module(*inputs, **kwargs)
        if torch.is_grad_enabled() and not swapped:
            self.reducer.prepare_for_backward(output, self.module.training, self.require_backward_grad_sync)
        return output

    # ---------------------------------------------------------------- skipped micro-steps (standin.py)
    join_active = property(lambda self: self._join is not None)

    def mark_micro_step(self) -> Mark:
        """This rank's counters as a micro-step begins (``stand_in`` compares against them)."""
        return standin.mark(self)

    def stand_in(self, start: Mark, sync: bool, again: bool = True) -> str:
        """Run the collectives the other ranks ran in a micro-step this rank skipped (``standin.py``)."""
        return standin.stand_in(self, start, sync, again)

    def advance_counters(self, micro_steps: int) -> None:
        """This rank runs ``micro_steps`` fewer micro-steps than the others in this window (an uneven
        plan: ``acc.plan_window``); count them as run, so the phase headers agree."""
        if self.will_broadcast_buffers() and next(self.module.buffers(), None) is not None:
            raise ValueError("gradsync: ranks with different numbers of micro-steps in a window cannot broadcast "
                             "buffers at every forward (each forward would pair with a different collective); "
                             "construct the model with broadcast_buffers=False, or give every rank the same count")
        c = self.reducer.counters
        c.forward += micro_steps * int(self.module.training)
        c.backward += micro_steps

    def failed_ranks(self) -> list[int]:
        """Ranks whose latest synced backward failed part-way (their window was reduced as nothing)."""
        return list(self.reducer.failed_ranks)

    def broadcast_buffers_from(self, src_rank: int) -> None:
        self._broadcast(list(self.module.buffers()), src_rank)

    def will_broadcast_buffers(self) -> bool:
        # Every training forward starts from rank 0's buffers, no_sync micro-steps included; eval
        # and no_grad forwards skip the broadcast, so rank-local evaluation needs no collective.
        return (self.forward_sync_buffers and self.require_forward_param_sync and self.world_size > 1
                and self.module.training and torch.is_grad_enabled())

    @property
    def broadcast_buffers(self) -> bool:
        """Deprecated alias of ``forward_sync_buffers`` (as in torch 2.13)."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    def _supersede(self) -> None:
        """A newer wrapper took over the parameters: release them and refuse to run."""
        self.reducer.remove_hooks()
        if self._delayed is not None:
            self._delayed.remove()
        self._superseded = True

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
        if self._join_config.enable and self._join is not None:
            self._join.check_backward(sync)
        return sync

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """Return a context manager for uneven inputs: wrap the training loop in ``with model.join():``.

        torch's meaning: a rank whose loop ends early keeps taking part in the others' collectives
        with zero gradients until every rank is done, then parameters (and buffers, unless
        ``forward_sync_buffers=False``) are copied from a rank that ran longest. Gradients divide
        by the initial world size, or with ``divide_by_initial_world_size=False`` by the number
        of ranks still active. ``throw_on_early_termination=True`` raises on every rank as soon
        as one runs out of data. Inside it, decide ``no_sync`` before each forward, and follow
        each forward made with gradients enabled by exactly one backward.
        """
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The ``Joinable`` hook: ``divide_by_initial_world_size`` (default True) as in ``join()``."""
        self.reducer.skips.forget()  # every rank enters the join here; a joined rank shadows every bucket
        return DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group

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
        try:
            check_comm_hook(hook)
        except (TypeError, ValueError) as exc:
            self._log_error(exc)  # torch's logger keeps it
            raise
        if self.reducer.launcher.hook is not None:  # torch's sentence: its tests match it
            self._log_and_throw(RuntimeError, "gradsync: register_comm_hook or register_builtin_comm_hook can "
                                "only be called once. This model already has a communication hook.")
        if self.reducer.backward_count > 0:
            self._log_and_throw(RuntimeError, "gradsync: register_comm_hook must be called before the first "
                                "backward")
        check_auto_cap_hook_state(self.reducer.auto_caps, state)
        self.reducer.launcher.set_hook(hook, state)

    def enable_comm_trace(self) -> list[dict]:
        """Start recording a per-bucket timeline of every synced backward; return the record list."""
        return self.reducer.enable_trace()

    @property
    def comm_trace(self) -> list[dict] | None:
        return self.reducer.trace

    @property
    def bucket_choice(self) -> dict | None:
        """With ``bucket_cap_mb="auto"``: the chosen cap and each candidate's median synced backward
        (max over ranks; ``engine/autocap.py``). None before the choice or without ``"auto"``."""
        auto = self.reducer.auto_caps
        return None if auto is None or auto.choice is None else auto.choice.as_dict()

    def wait(self, handle: Any, what: str) -> None:
        """Wait for a collective's Work or future, bounded by ``timeout``, naming ``what`` if it fails."""
        self.reducer.wait(handle, what)

    def carry_with_next_sync(self, values: Sequence[float]) -> Callable[[], dict[int, tuple]] | None:
        """Send ``values`` in the next synced backward's phase header (no collective of its own, so it
        cannot pair with a different one on a rank that disagrees); return a reader of the active
        ranks' values by rank. None: headers are switched off (a measurement): exchange them yourself."""
        plane = self.reducer.plane
        return plane.carry(values) if plane.headers else None

    def control_group(self) -> tuple[dist.ProcessGroup, torch.device]:
        """The control plane's group and device: a layer's own small exchanges go there (``plane.py``)."""
        return self.reducer.plane.group, self.reducer.plane.device

    def scale_grads_(self, factor: float) -> None:
        """Multiply every synchronized gradient by ``factor`` (used by the accumulator)."""
        if self.reducer.bucket_reduced is not None and factor != 1.0:
            raise RuntimeError(
                "gradsync: gradients must be rescaled after the synced backward (GradientAccumulator "
                "with num_items, or a window that ended early), but overlap_optimizer already stepped "
                "on them inside that backward. Use mean losses over full windows, or remove overlap_optimizer.")
        grads = self.reducer.store.grad_tensors()
        if grads:
            foreach_mul_(grads, factor)

    def grad_state_dict(self) -> dict[str, Any]:
        """Return this rank's gradients and the bucket layout: save both at every checkpoint.

        Mid-window, the accumulated micro-steps are training state; the layout (re-planned after
        the first synced backward) decides the summation order of every later reduction.
        """
        return grad_state(self.reducer)

    def load_grad_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``grad_state_dict()`` of the same rank, before the first backward."""
        load_grad_state(self.reducer, state)


def should_sync_of(ddp: DistributedDataParallel) -> Callable[[], bool]:
    """The reducer's ``should_sync``, holding the wrapper weakly so that it can be collected."""
    method = weakref.WeakMethod(ddp._backward_syncs)

    def should_sync() -> bool:
        bound = method()
        return bound is not None and bool(bound())
    return should_sync


DDP = DistributedDataParallel
__all__ = ["DistributedDataParallel", "DDP", "SyncError"]
