"""Per-iteration gradient reduction: readiness tracking and the end of backward.

The reducer knows parameters, buckets and a process group; it knows nothing about modules or
optimizers. Each parameter gets a post-accumulate-grad hook. In a synced backward a ready
gradient is copied into its bucket slot, and buckets are launched strictly in index order on
every rank, so collectives pair up across ranks even when hooks fire in different orders. The
end of backward is caught with the autograd engine's queued callback, where the reducer waits
(bounded) for every bucket and writes the averages back into ``.grad``. Bucket memory lives in
``storage.py``, launches and waits in ``launcher.py``, the end of a synced backward (waits,
checks, write-back) in ``finish.py``; this file is the state machine.

Each synced backward starts with the phase header of ``header.py`` (ranks in different phases
raise instead of waiting for the timeout) and ends with the control all-reduce of
``control.py``, which checks the counters again and finds missing or unused gradients.
"""
from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import guard
from .autocap import AutoCaps
from .buckets import plan_buckets
from .comm import CommHook
from ._torch import in_compiled_autograd, queue_end_of_backward
from .finish import SyncEnd
from .graph import reachable_params
from .header import BACKWARD
from .launcher import BucketLauncher
from .storage import BucketStorage


class Reducer(SyncEnd, BucketStorage, BucketLauncher):
    """Per-iteration state machine; bucket memory in ``BucketStorage``, launches in ``BucketLauncher``,
    the end of a synced backward in ``SyncEnd``."""

    wrapper_name = "DistributedDataParallel"  # named by the unsynchronized-step error
    _compiled_autograd = False  # the current backward runs under compiled autograd (compile.py)
    replans_buckets = True  # False: buckets are fixed at construction (no re-plan, no "auto" cap)

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        process_group: dist.ProcessGroup,
        *,
        should_sync: Callable[[], bool],
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float = 1.0,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        timeout: timedelta,
        reduce_dtype: torch.dtype | None = None,
        auto_bucket_cap: bool = False,
        auto_first_bucket_cap_mb: float | None = None,
    ):
        self.params = list(params)
        self.names = list(names)
        self.device = self.params[0].device  # where small control tensors live: NCCL needs the GPU
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.should_sync = should_sync
        self.bucket_cap_mb = bucket_cap_mb
        self.first_bucket_cap_mb = first_bucket_cap_mb
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.reduce_dtype = reduce_dtype  # see precision.py
        self.timeout = timeout
        self.comm_hook: CommHook | None = None
        self.comm_state: Any = None
        self.trace: list[dict] | None = None  # set to [] to record a timeline per synced backward
        self.check_finite = False  # check each reduced bucket for NaN/inf before writing back
        self.active_ranks: list[int] | None = None  # set per forward inside DDP.join(); None: all
        self.bucket_reduced: Callable[[list[int]], None] | None = None  # overlap_optimizer's per-bucket step
        self.auto_caps = AutoCaps(auto_first_bucket_cap_mb) if auto_bucket_cap else None  # autocap.py
        if self.auto_caps is not None:
            self.auto_caps.start(self)

        n = len(self.params)
        self.backward_count = 0  # every backward, synced or not: the divergence check compares it
        self.sync_count = 0
        self.forward_count = 0  # training forwards with grad enabled: catches skipped backwards
        self._in_backward = False
        self._syncing = False
        self._warned_ignored = False
        self._pending_forwards = 0  # forwards (or prepare_for_backward calls) not yet followed by a backward
        self._armed = False  # the latest forward wanted its backward to synchronize
        self._window_used = [False] * n  # used locally since the last synced backward
        self._fresh = [True] * n  # reduce_dtype: the next gradient replaces the slot (precision.py)
        self._ready = [False] * n
        self._hook_counts = [0] * n
        self._static_counts: list[int] | None = None  # learned in the first synced backward
        self._reachable: set[int] = set()
        self._index_of = {id(p): i for i, p in enumerate(self.params)}
        self._ready_order: list[int] | None = None
        self._rebuilt = False
        self._next_launch = 0
        self._iter_trace: dict | None = None

        self._build_buckets(plan_buckets(self.params, bucket_cap_mb, first_bucket_cap_mb))
        # the hooks hold the reducer weakly: parameters outlive a wrapper that was deleted
        me = weakref.ref(self)
        self._handles = [p.register_post_accumulate_grad_hook(_hook(me, i)) for i, p in enumerate(self.params)]
        if self.world_size > 1:
            guard.install()  # now, not at the first local backward: a step's closure may run that

    # ---------------------------------------------------------------- forward side
    def prepare_for_forward(self) -> None:
        if self._in_backward:  # the last backward raised before its end: drop its state
            if self._syncing and self._compiled_autograd:
                raise RuntimeError(
                    "gradsync: under compiled autograd a synced backward ends when its last bucket "
                    "launches, and the previous one ended with buckets unlaunched: some parameters "
                    "expected to get a gradient got none (find_unused_parameters with a parameter used "
                    "only in earlier no_sync micro-steps, or static_graph's first iteration). Set "
                    "torch._dynamo.config.compiled_autograd = False for such steps.")
            self._reset_iteration()

    def prepare_for_backward(self, outputs: Any, training: bool = True, sync: bool = True) -> None:
        """Note that a backward may follow; with ``find_unused_parameters``, find reachable params.

        ``sync`` is the forward's wish (torch decides at forward; gradsync also reads the flag
        again at backward, so ``no_sync`` may wrap either). Several forwards may precede their
        backwards; the latest forward's wish holds, as in torch, where frameworks call this with
        an empty ``outputs`` to make the next backward synchronize. Only training-mode forwards
        count for the skipped-backward check: an evaluation forward that forgot
        ``torch.no_grad()`` on one rank is harmless and must not fail the next step.
        """
        self._pending_forwards += 1
        self._armed = bool(sync)
        self.forward_count += training
        if self.find_unused_parameters and not (self.static_graph and self._static_counts is not None):
            self._reachable |= reachable_params(outputs, self._index_of)

    # ---------------------------------------------------------------- backward side
    def on_grad_ready(self, i: int, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook of parameter ``i``."""
        if not self._in_backward:
            self._begin_backward()
        if param.grad is not None:  # autograd may leave it undefined: that is not a use (torch agrees)
            self._window_used[i] = True
        if self._syncing:
            if self._ready_order is not None:
                self._ready_order.append(i)
            self._mark_ready(i)
            if self._compiled_autograd and self._next_launch == len(self.buckets):
                self._finalize()  # the last bucket launched: compiled autograd never runs queued callbacks
        else:
            self._keep_local(i)

    def _begin_backward(self) -> None:
        self._in_backward = True
        self._compiled_autograd = in_compiled_autograd()
        if self._compiled_autograd:
            self._mark_unsynced()  # until its last bucket ends the sync: no optimizer step before
        else:
            queue_end_of_backward(self._finalize)
        if self._pending_forwards == 0:  # no forward of the wrapper prepared it: local, as in torch
            self._warn_unprepared_backward()
        else:
            self._pending_forwards -= 1
            self.backward_count += 1
            if self.backward_count == 1:  # gradients restored from a mid-window checkpoint are window state
                self._window_used = [self._has_local_grad(i) for i in range(len(self.params))]
            self._syncing = self._armed and bool(self.should_sync())
        if not self._syncing:
            self._mark_unsynced()
            return
        self._ready = [False] * len(self.params)
        self._hook_counts = [0] * len(self.params)
        self._next_launch = 0
        for b in self.buckets:
            b.pending = len(b.members)
            b.handle = None
        self.launch_header(BACKWARD)  # checked before the first bucket launches
        if self._ready_order is None and not self._rebuilt:
            self._ready_order = []
        if self.trace is not None:
            self._iter_trace = {"iteration": self.sync_count, "backward_start": time.perf_counter(),
                                "buckets": []}
        if self.static_graph and self._static_counts is not None:
            unused = [i for i, c in enumerate(self._static_counts) if c == 0]
        elif self.find_unused_parameters:
            unused = [i for i in range(len(self.params)) if i not in self._reachable]
        else:
            unused = []
        self._reachable = set()
        for i in unused:
            self._mark_ready(i, from_hook=False)

    def _mark_ready(self, i: int, from_hook: bool = True) -> None:
        if self.static_graph:
            self._hook_counts[i] += from_hook
            if self._static_counts is None:
                return  # first synced backward: learn how often each hook fires, launch at the end
            expected = self._static_counts[i]
            if self._hook_counts[i] > expected:
                raise RuntimeError(
                    f"gradsync: static_graph=True, but parameter '{self.names[i]}' produced a gradient "
                    f"{self._hook_counts[i]} times in this backward and {expected} times in the first "
                    "iteration. The graph changed; construct the model with static_graph=False."
                )
            if from_hook and self._hook_counts[i] < expected:
                return
        elif self._ready[i]:
            raise RuntimeError(
                f"gradsync: parameter '{self.names[i]}' was marked ready twice in one backward: it took "
                "part in the backward more than once (e.g. reentrant activation checkpointing, or a "
                "module reused across a nested backward). Pass static_graph=True if the graph is the "
                "same every iteration, or use torch.utils.checkpoint(..., use_reentrant=False)."
            )
        self._ready[i] = True
        self._copy_to_bucket(i)
        bucket = self.buckets[self._bucket_of[i]]
        bucket.pending -= 1
        if bucket.pending == 0:
            if self._iter_trace is not None:
                bucket.times = {"ready": time.perf_counter()}
            self._launch_ready_buckets()

    # ---------------------------------------------------------------- end of backward
    def _warn_unprepared_backward(self) -> None:
        """Once: a backward that no forward of the wrapper prepared stays local, like torch's.

        Its gradients stay in ``.grad`` and count as used in the window, so the next synced
        backward reduces them. A second backward through one forward (``retain_graph=True``)
        lands here too.
        """
        if not self._warned_ignored:
            self._warned_ignored = True
            warnings.warn(
                "gradsync: a backward ran without a forward of the DistributedDataParallel model "
                "since the previous backward (a second backward through one forward, or a forward "
                "that bypassed the wrapper). As in torch, its gradients were not synchronized now; "
                "they are reduced at the next synchronizing backward. Call model(...) before each "
                "backward; to combine several losses from one forward, add them and call backward once.",
                stacklevel=2)

    def _reset_iteration(self) -> None:
        self._in_backward = False
        self._syncing = False
        self._iter_trace = None
        self._header_work = None

    def _mark_unsynced(self) -> None:
        if self.world_size > 1:  # on one rank every gradient is already the global one
            guard.mark_unsynced(self)

    def unsynced_params(self) -> list[int]:
        """Indices of parameters holding gradients from backwards since the last synced one."""
        return [i for i, used in enumerate(self._window_used) if used and self._has_local_grad(i)]

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        guard.forget(self)


def _hook(reducer: weakref.ref, i: int) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        me = reducer()
        if me is not None:  # once the wrapper is gone, its parameters train locally
            me.on_grad_ready(i, param)
    return hook
