"""The ``DistributedDataParallel`` module wrapper: forward, ``no_sync``, comm hooks, join, pickling.

Constructor keywords are resolved in ``options.py`` and checked in ``construct.py``; the gradients'
trip is the engine's (``engine/reducer.py``). Features attach where the wrapper announces itself
(``process.announce("wrapper", ...)``).
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Joinable, JoinHook

from .. import process
from .._torch import foreach_mul_, join_enabled, to_kwargs
from ..engine import messages, replay
from ..engine.autocap import check_auto_cap_hook_state
from ..engine.config import ReducerConfig
from ..engine.control import FORWARD
from ..engine.errors import PeerFailure, SyncError
from ..engine.launcher import CommHook
from ..engine.protocol import after_commit
from ..engine.reducer import Reducer
from . import guard, torch_extras
from .compile import active_ddp, bucket_bytes_caps, skip_wrapper_frames
from .construct import broadcast_coalesced, check_comm_hook, check_group, claim, initial_wait, verify_same_model
from .delay import DelayedAllReduce
from ..deterministic import ordered_parts
from .grad_state import grad_state, load_grad_state, zero_grad
from .join import DDPJoinHook, Join
from .options import resolve
from .snapshot import module_tensors, parameters_swapped, snapshot


class DistributedDataParallel(nn.Module, Joinable):
    """Data parallelism with bucketed, backward-overlapped gradient averaging.

    A drop-in for ``torch.nn.parallel.DistributedDataParallel`` (torch 2.13): the same constructor
    arguments with torch's meaning, ``no_sync()``, comm hooks, ``join()`` (a ``Joinable``), pickling,
    and a ``module.``-prefixed state dict. gradsync's own keywords: ``first_bucket_cap_mb`` (the first
    bucket's cap), ``timeout`` (bounds every wait on a collective; default: the group's),
    ``check_finite`` (raise ``FloatingPointError`` naming the parameters whose reduced gradient is not
    finite, before writing back), ``reduce_dtype`` (accumulate and reduce in that dtype: ``param.main_grad``
    is the average, ``.grad`` its copy in the parameter's dtype), ``straggler_warning``, ``check_replicas``
    (docs/replicas.md), ``deterministic`` (the same gradient bits for any power-of-two world size:
    docs/deterministic.md) and ``bucket_cap_mb="auto"``. docs/differences.md lists every difference from torch's DDP.
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
                 reduce_dtype: torch.dtype | None = None, straggler_warning: bool = True, check_replicas: bool = False,
                 deterministic: bool = False):
        super().__init__()
        Joinable.__init__(self)
        options = resolve(  # every refusal comes here, before the first collective (verify_same_model)
            type(self), module, refuse=(DistributedDataParallel,), device_ids=device_ids, output_device=output_device,
            broadcast_buffers=broadcast_buffers, process_group=process_group, bucket_cap_mb=bucket_cap_mb,
            find_unused_parameters=find_unused_parameters, check_reduction=check_reduction,
            gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph,
            delay_all_reduce_named_params=delay_all_reduce_named_params, param_to_hook_all_reduce=param_to_hook_all_reduce,
            mixed_precision=mixed_precision, device_mesh=device_mesh, bucket_cap_mb_list=bucket_cap_mb_list,
            skip_all_reduce_unused_params=skip_all_reduce_unused_params, forward_sync_buffers=forward_sync_buffers,
            first_bucket_cap_mb=first_bucket_cap_mb, timeout=timeout, check_finite=check_finite,
            reduce_dtype=reduce_dtype, straggler_warning=straggler_warning, sharded=self.sharded, check_replicas=check_replicas,
            deterministic=deterministic)
        self.process_group, self.device_ids, self.output_device = options.process_group, options.device_ids, options.output_device
        if device_mesh is not None:
            self.device_mesh = device_mesh
        self.module, self.dim, self.device = module, dim, options.device
        self.forward_sync_buffers = options.forward_sync_buffers
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True  # False: the next forwards do not sync buffers
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.batched_grad_copy = batched_grad_copy
        self.world_size = dist.get_world_size(self.process_group)
        skip_wrapper_frames()
        # the hook parameter unregistered (in __dict__): it is the module's, not the wrapper's, as in torch's state_dict
        self.reduced_names, self.delayed_names, self.__dict__["delay_trigger"] = options.reduced, list(options.delayed), param_to_hook_all_reduce
        if init_sync:  # before the reducer allocates its buckets: peak memory is one model copy less
            verify_same_model(module, self.process_group, options, self.device)
            if self.world_size > 1:
                self.broadcast_tensors(list(module.parameters()) + (list(module.buffers())
                                       if options.init_sync_buffers else []), timeout=options.config.timeout)
        self.param_snapshot = snapshot(module, may_freeze=not static_graph and not self.delayed_names)
        self.build_reducer(options.config)
        # a feature that follows the default group (gradsync.elastic) attaches here
        process.announce("wrapper", self, process_group is None and device_mesh is None)

    def make_reducer(self, params: list[nn.Parameter], names: list[str], config: ReducerConfig) -> Reducer:
        parts = ordered_parts(params, names, self.process_group, config) if config.deterministic else {}
        return Reducer(params, names, self.process_group, config, switch=self, **parts)  # sharded plugs in its parts

    def build_reducer(self, config: ReducerConfig) -> None:
        named = dict(self.module.named_parameters())
        params = [named[n] for n in self.reduced_names]
        self.reducer = reducer = self.make_reducer(params, list(self.reduced_names), config)
        guard.watch(reducer)
        weakref.finalize(self, guard.release, reducer)  # a deleted wrapper leaves no hooks behind
        self.join_state: DDPJoinHook | None = None  # set by join_hook() while a join is configured
        self.delayed = None
        if self.delayed_names:
            self.delayed = DelayedAllReduce(self, [named[n] for n in self.delayed_names], self.delay_trigger)
            weakref.finalize(self, self.delayed.remove)
        claim(params + (self.delayed.params if self.delayed else []), self)

    def follow_group(self, group: dist.ProcessGroup) -> None:
        """The reducer now reduces over ``group`` (a commit protocol re-formed it): follow it."""
        self.process_group, self.world_size = group, dist.get_world_size(group)
        guard.watch(self.reducer)  # a replica that joined was built on a group of its own

    def wait(self, handle: Any, what: str = "a broadcast of parameters or buffers",
             timeout: timedelta | None = None) -> None:
        """Wait for a collective's Work or future, bounded by ``timeout``, naming ``what`` if it fails."""
        reducer = self.__dict__.get("reducer")
        if reducer is None:  # the initial broadcast
            initial_wait(handle, timeout, dist.get_rank(self.process_group))
        else:
            reducer.wait(handle, what)

    def broadcast_tensors(self, tensors: list[torch.Tensor], src_rank: int = 0, timeout: timedelta | None = None, in_place=True) -> None:
        """Copy ``tensors`` from ``src_rank`` (an index in the wrapper's group) to every rank, bounded."""
        wait = self.wait if timeout is None else lambda work: self.wait(work, timeout=timeout)
        broadcast_coalesced(tensors, self.process_group, wait, src_rank, in_place=in_place)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if getattr(self, "superseded", False):
            raise RuntimeError("gradsync: this DistributedDataParallel no longer synchronizes: its module (or part of it) was wrapped again by a "
                               "newer DistributedDataParallel, which owns the parameters now (copy.copy shares the module: use copy.deepcopy).")
        reducer = self.reducer
        reducer.prepare_for_forward()
        if self.delayed is not None:
            self.delayed.prepare_for_forward()
        current, module_buffers = module_tensors(self.module, self.param_snapshot)  # a walk only after a change
        swapped = parameters_swapped(self.module, self.param_snapshot, reducer.params, current)
        check_group(self.process_group)
        src = self.join_state.before_forward() if self.join_state is not None and join_enabled(self) else 0
        buffers = module_buffers if self.will_broadcast_buffers() else []
        if buffers and (reducer.attached is None or reducer.attached.broken is None):
            try:
                reducer.plane.exchange_header(FORWARD)  # a rank still in its backward must not meet a broadcast
                self.broadcast_tensors(buffers, src, in_place=reducer.attached is None)  # elastic: through a copy
            except PeerFailure as exc:  # only with a commit protocol: local buffers until it re-forms
                reducer.attached.lose_group(exc)
        if self.device_ids:  # a single-GPU module: inputs move to its device, as in torch
            inputs, kwargs = to_kwargs(inputs, kwargs, torch.device(self.device.type, self.device_ids[0]))
        with active_ddp(self, bucket_bytes_caps(*reducer.store.caps)[1]):  # compiled frames split at bucket boundaries
            output = self.module(*inputs, **kwargs)
        if torch.is_grad_enabled() and not swapped:
            reducer.prepare_for_backward(output, self.module.training, self.require_backward_grad_sync)
        return output

    def mark_micro_step(self) -> replay.Mark:
        """This rank's counters as a micro-step begins (``stand_in`` compares against them)."""
        return replay.mark(self)

    def stand_in(self, start: replay.Mark, sync: bool, again: bool = True) -> str:
        """Run the collectives the other ranks ran in a micro-step this rank skipped."""
        return replay.stand_in(self, start, sync, again)

    def advance_counters(self, micro_steps: int) -> None:
        """Count ``micro_steps`` this rank does not run in this window (``acc.plan_window``), as the others run them."""
        replay.advance(self, micro_steps)

    def keep_window_apart(self) -> None:
        """Keep the window apart from the buckets in flight: a synced backward that fails part-way is reduced again."""
        replay.keep_window_apart(self.reducer)

    def failed_ranks(self) -> list[int]:
        """Ranks whose latest synced backward failed part-way (their window was reduced as nothing)."""
        return list(self.reducer.failed_ranks)

    def after_commit(self, what: str, exchange: Callable[[], Any]) -> Any:
        """Run a layer's own collectives after the synced backward's commit (``protocol.after_commit``)."""
        return after_commit(self.reducer, what, exchange)

    def will_broadcast_buffers(self) -> bool:
        # every training forward (no_sync too); eval and no_grad forwards skip it: local evaluation, no collective
        return (self.forward_sync_buffers and self.require_forward_param_sync and self.world_size > 1
                and self.module.training and torch.is_grad_enabled())

    broadcast_buffers = property(lambda self: self.forward_sync_buffers,  # deprecated alias, as in torch 2.13
                                 lambda self, value: setattr(self, "forward_sync_buffers", value))

    def supersede(self) -> None:
        """A newer wrapper took over the parameters: release them and refuse to run."""
        guard.release(self.reducer)
        if self.delayed is not None:
            self.delayed.remove()
        self.superseded = True

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """Uneven inputs, torch's meaning: wrap the training loop in ``with model.join():``. A rank whose
        loop ends early shadows the others' collectives with zero gradients; then parameters (and
        buffers) are copied from a rank that ran longest. Inside it, decide ``no_sync`` before each
        forward, and follow each forward made with gradients enabled by exactly one backward."""
        return Join([self], enable, throw_on_early_termination, divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The ``Joinable`` hook: ``divide_by_initial_world_size`` (default True) as in ``join()``."""
        self.reducer.skips.forget()  # every rank enters the join here; a joined rank shadows every bucket
        return DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    join_device = property(lambda self: self.device)
    join_process_group = property(lambda self: self.process_group)

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
            raise self._log_error(exc)  # torch's logger keeps it
        if self.reducer.launcher.hook is not None:  # torch's sentence: its tests match it
            self._log_and_throw(RuntimeError, "gradsync: register_comm_hook or register_builtin_comm_hook can "
                                "only be called once. This model already has a communication hook.")
        if self.reducer.backward_count > 0:
            self._log_and_throw(RuntimeError, "gradsync: register_comm_hook must be called before the first backward")
        check_auto_cap_hook_state(self.reducer.auto_caps, state)
        self.reducer.launcher.set_hook(hook, state)

    def enable_comm_trace(self) -> list[dict]:
        """Start recording a per-bucket timeline of every synced backward; return the record list."""
        return self.reducer.enable_trace()
    comm_trace = property(lambda self: self.reducer.trace)

    def export_trace(self, path: str) -> None:
        """Write every rank's comm trace to ``path`` as one Chrome trace / Perfetto JSON (every rank calls it)."""
        torch_extras.export_trace(self, path)

    def sync_report(self) -> Any:
        """The synced backward before the latest (its waits ride in the latest's control), the same on every
        rank: ``sync``, ``ranks[r].compute_ms`` / ``.wait_ms``, ``slowest``; or None (``engine/telemetry.py``)."""
        return self.reducer.last_report

    def measure_local_norms(self) -> Callable[[], dict[int, float] | None]:
        """Carry every rank's local squared gradient norm in each synced control; return the latest's reader."""
        self.reducer.measure_norm = True
        return lambda: self.reducer.local_norms

    @property
    def bucket_choice(self) -> dict | None:
        """``bucket_cap_mb="auto"``'s choice and each candidate's median (``engine/autocap.py``), or None."""
        auto = self.reducer.auto_caps
        return None if auto is None or auto.choice is None else auto.choice.as_dict()

    def carry_with_next_sync(self, values: Sequence[float]) -> Callable[[], dict[int, tuple]] | None:
        """Send ``values`` in the next synced backward's header; return their reader (None: headers are off)."""
        plane = self.reducer.plane
        return plane.carry(values) if plane.headers else None

    def control_group(self) -> tuple[dist.ProcessGroup, torch.device]:
        """The control plane's group and device: a feature's own small exchanges go there."""
        return self.reducer.plane.group, self.reducer.plane.device

    def scale_grads_(self, factor: float) -> None:
        """Multiply every synchronized gradient by ``factor`` (used by the accumulator)."""
        if self.reducer.bucket_reduced is not None and factor != 1.0:
            raise RuntimeError(messages.RESCALE_AFTER_OVERLAP)
        grads = self.reducer.store.grad_tensors() + (self.delayed.grads() if self.delayed is not None else [])
        if grads:
            foreach_mul_(grads, factor)

    def grad_state_dict(self) -> dict[str, Any]:
        """This rank's gradients and the bucket layout: save both at every checkpoint (``grad_state.py``)."""
        return grad_state(self.reducer)

    def load_grad_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``grad_state_dict()`` of the same rank, before the first backward."""
        load_grad_state(self.reducer, state)

    # ---------------------------------------------------------------- torch's attributes and private switches
    find_unused_parameters = property(lambda self: self.reducer.config.find_unused_parameters)
    gradient_as_bucket_view = property(lambda self: self.reducer.config.gradient_as_bucket_view)
    static_graph = property(lambda self: self.reducer.config.static_graph)
    timeout = property(lambda self: self.reducer.config.timeout)
    # Dynamo's DDP optimizer splits compiled graphs at the cap in use ("auto" changes it while it chooses)
    bucket_bytes_cap = property(lambda self: bucket_bytes_caps(*self.reducer.store.caps)[0])
    zero_grad = zero_grad  # nn.Module's, and reduce_dtype's slots, where a window's gradients wait (grad_state.py)

    def __getstate__(self) -> dict[str, Any]:  # without the process group and reducer, as torch's
        return torch_extras.getstate(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild on the default process group: a fresh reducer, no collective."""
        self.process_group = dist.group.WORLD
        config = state.pop("reducer_config")
        super().__setstate__({**state, "world_size": dist.get_world_size()})  # loaded on a group of another size
        self.build_reducer(config)

    _set_static_graph = torch_extras.set_static_graph

    def _log_and_throw(self, err_type: type[Exception], err_msg: str) -> NoReturn:
        raise torch_extras.log_error(self, err_type(err_msg))

    _log_error = torch_extras.log_error

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        return torch_extras.logging_data(self)


DDP = DistributedDataParallel
__all__ = ["DistributedDataParallel", "DDP", "SyncError"]
