"""The reducer: per-iteration state machine from a gradient's hook to the end of backward.

The reducer knows parameters, buckets and a process group; it knows nothing about modules or
optimizers. It is composed of owned parts, each built here with explicit arguments:

- ``store`` (``store.py``): bucket memory: copy-in, write-back, re-plan;
- ``launcher`` (``launcher.py``): the data plane: a bucket's collective and its result;
- ``plane`` (``plane.py``): the control plane: phase headers, the end-of-backward control, waits;
- ``it`` (``IterationState``): what one backward has seen so far.

One gradient's path: its post-accumulate-grad hook calls ``on_grad_ready``; in a synced backward
``store.copy_in`` puts it in its bucket slot; a bucket whose members are all ready launches, in
index order on every rank (``_launch_ready``); the end of backward (the autograd engine's queued
callback) waits for every bucket, checks the control all-reduce, and ``store.write_back`` makes
``.grad`` the average (``_finish_sync``).
"""
from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from . import guard, membership, messages, standin
from ._torch import in_compiled_autograd, queue_end_of_backward
from .autocap import AutoCaps
from .config import ReducerConfig
from .control import check_agreement, check_finite, check_missing, control_tensor, failed_ranks, used_counts
from .graph import Expected
from .header import BACKWARD
from .launcher import BucketLauncher
from .layout import Layout
from .membership import PeerFailure
from .plane import ControlPlane, Counters, control_group
from .skip import UnusedBuckets
from .store import BucketStore
from .telemetry import Stragglers, SyncReport, local_norm2, record_report


@dataclass
class IterationState:
    """What the current backward has seen; replaced at the start of each synced backward."""

    in_backward: bool = False
    syncing: bool = False
    compiled_autograd: bool = False  # under compiled autograd no queued callback runs (compile.py)
    ready: list[bool] = field(default_factory=list)
    hook_counts: list[int] = field(default_factory=list)
    next_launch: int = 0  # the lowest bucket index not launched yet
    hooked: list[bool] | None = None  # which parameters this backward's hooks made ready (kept for a redo)
    t_ready: float | None = None  # when the latest gradient of a synced backward was ready (telemetry.py)
    hook_wait: float = 0.0  # seconds its hooks waited on the phase header (others' work, not this rank's)
    norm2: Any = None  # with measure_norm: the squared norm of what went into the buckets
    record: dict | None = None  # this backward's comm trace, when tracing
    # read once per synced backward, not in each gradient's hook
    divide: bool = True  # the store divides as it copies in (launcher.divides_on_copy)
    static: bool = False  # static_graph: the hooks are counted (graph.py)
    order: list[int] | None = None  # the first synced backward's gradient-ready order (layout.py)


class Reducer:
    """Runs the state machine and calls its parts; see the module docstring."""

    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str], process_group: dist.ProcessGroup,
                 config: ReducerConfig, *, should_sync: Callable[[], bool], store: Any = None,
                 launcher: Callable[[ControlPlane], Any] | None = None):
        """``store`` and ``launcher`` (a factory given the control plane) replace the full-size
        all-reduce parts (``ShardedDataParallel`` plugs in its own)."""
        self.params, self.names = list(params), list(names)
        self.config = config
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.device = self.params[0].device  # the data plane's
        self.should_sync = should_sync
        self.counters = Counters()
        group, device = control_group(process_group, self.device)  # off CPU, a CPU group: no host syncs
        self.plane = ControlPlane(group, rank=self.rank, world_size=self.world_size, device=device,
                                  timeout=config.timeout, counters=self.counters, data_device=self.device)
        self.store = store or BucketStore(self.params, self.names, world_size=self.world_size, caps=config.caps,
                                          reduce_dtype=config.reduce_dtype,
                                          gradient_as_bucket_view=config.gradient_as_bucket_view,
                                          # no re-plan from the observed order: keep torch's first layout
                                          registration_walk=config.find_unused_parameters and not config.static_graph)
        self.launcher = launcher(self.plane) if launcher else BucketLauncher(process_group, self.plane, self.params)
        self.it = IterationState()
        self.trace: list[dict] | None = None  # set to [] to record a timeline per synced backward
        self.bucket_reduced: Callable[[list[int]], None] | None = None  # see on_bucket_reduced
        n = len(self.params)
        self.index_of = {id(p): i for i, p in enumerate(self.params)}
        self.window_used = [False] * n  # used locally since the last synced backward
        self.failed_ranks: list[int] = []  # ranks whose latest synced backward failed part-way
        self.pending_forwards = 0  # forwards not yet followed by a backward
        # elastic membership (membership.py): set by the wrapper; ``broken`` holds the failure that made
        # this rank stop using its group until the window's synced backward re-forms it
        self.membership: Any = None
        self.broken: BaseException | None = None
        self.window_source: Callable[[], tuple[int, int]] | None = None  # the accumulator's window, for events
        self.on_regroup: Callable[[dist.ProcessGroup], None] | None = None  # the wrapper follows the new group
        self.last_report: SyncReport | None = None  # the latest synced backward's timings (telemetry.py)
        self.stragglers = Stragglers() if config.straggler_warning else None
        self.measure_norm = False  # GradientAccumulator(noise_scale=True): each rank's local squared norm
        self._forward_end = time.perf_counter()
        self._armed = False  # the latest forward wanted its backward to synchronize
        self.expected = Expected(self.index_of)  # graph.py: unused parameters, static_graph's counts
        self.skips = UnusedBuckets(config.skip_all_reduce_unused_params)  # skip.py: buckets no rank uses
        self.last_error: tuple[int, str] | None = None  # torch's logger keeps the latest error (torch_extras.py)
        self._warned_ignored = False
        self.layout = Layout(self.store, self.plane, process_group, config)
        self.auto_caps = AutoCaps(config.user_first_bucket_cap_mb, self) if config.auto_bucket_cap else None
        self.layout.auto = self.auto_caps
        me = weakref.ref(self)  # the hooks hold the reducer weakly: parameters outlive a deleted wrapper
        self._handles = [p.register_post_accumulate_grad_hook(_hook(me, i)) for i, p in enumerate(self.params)]
        if self.store.exclusive:
            guard.mark_exclusive(self)
        if self.world_size > 1:
            guard.install(self)  # now, not at the first local backward: a step's closure may run that

    # ---------------------------------------------------------------- what the layers may use (seam.py)
    buckets = property(lambda self: self.store.buckets)
    sync_count = property(lambda self: self.counters.sync)
    backward_count = property(lambda self: self.counters.backward)
    is_sharded = property(lambda self: self.store.sharded)
    wrapper_name = property(lambda self: self.config.wrapper_name)  # named by the step guard's error

    def bucket_plan(self) -> list[list[int]]:
        """The current buckets as lists of parameter indices."""
        return self.store.plan()

    def wait(self, handle: Any, what: str) -> None:
        """Wait for a Work or Future, bounded by the timeout (``plane.wait``)."""
        self.plane.wait(handle, what)

    def on_bucket_reduced(self, callback: Callable[[list[int]], None] | None) -> None:
        """Write back each bucket as soon as it is reduced and call ``callback(members)`` (overlap.py)."""
        self.bucket_reduced = callback

    def enable_trace(self) -> list[dict]:
        """Record a per-bucket timeline of every synced backward from now on; return the record list."""
        if self.trace is None:
            self.trace = []
        if self.auto_caps is not None:  # "auto" traces while it chooses: keep tracing after
            self.auto_caps.keep_trace()
        return self.trace

    def disable_trace(self) -> None:
        self.trace = None

    def set_static_graph(self) -> None:  # torch's private _set_static_graph(), before the first backward
        self.config = replace(self.config, static_graph=True)

    # ---------------------------------------------------------------- forward side
    def prepare_for_forward(self) -> None:
        if self.it.in_backward:  # the last backward raised before its end: drop its state
            if self.it.syncing and self.it.compiled_autograd:
                raise RuntimeError(messages.COMPILED_AUTOGRAD_UNFINISHED)
            self._reset_iteration()

    def prepare_for_backward(self, outputs: Any, training: bool = True, sync: bool = True) -> None:
        """Note that a backward may follow; with ``find_unused_parameters``, find reachable params.

        ``sync`` is the forward's wish; the flag is read again at backward, so ``no_sync`` may wrap
        either. The latest forward's wish holds, as in torch (frameworks call this with empty
        ``outputs`` to make the next backward sync). Only training forwards count for the
        skipped-backward check: an evaluation forward without ``torch.no_grad()`` is harmless.
        """
        self.pending_forwards += 1
        self._forward_end = time.perf_counter()  # a synced backward's own work is timed from here
        self._armed = bool(sync)
        self.counters.forward += training
        self.expected.note_forward(outputs, self.config)

    # ---------------------------------------------------------------- backward side
    def on_grad_ready(self, i: int, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook of parameter ``i``."""
        it = self.it
        if not it.in_backward:
            self._begin_backward()
            it = self.it
        if param.grad is not None:  # autograd may leave it undefined: that is not a use (torch agrees)
            self.window_used[i] = True
        if it.syncing:
            if it.order is not None:  # Layout.note_ready
                it.order.append(i)
            self._mark_ready(i, hooked=True)
            if it.compiled_autograd and it.next_launch == len(self.store.buckets):
                self._finalize()  # the last bucket launched: compiled autograd never runs queued callbacks
        else:
            self.store.keep_local(i)

    def _begin_backward(self) -> None:
        compiled = in_compiled_autograd()
        self.it = it = IterationState(in_backward=True, compiled_autograd=compiled)
        if compiled:
            self._mark_unsynced()  # until its last bucket ends the sync: no optimizer step before
        else:
            queue_end_of_backward(self._finalize)
        syncing = False
        if self.pending_forwards == 0:  # no forward of the wrapper prepared it: local, as in torch
            if not self._warned_ignored:  # its gradients are reduced at the next synced backward
                self._warned_ignored = True
                warnings.warn(messages.UNPREPARED_BACKWARD, stacklevel=3)
        else:
            self.pending_forwards -= 1
            self.counters.backward += 1
            if self.counters.backward == 1:  # gradients restored from a mid-window checkpoint are window state
                self.window_used = [self.store.has_local_grad(i) for i in range(len(self.params))]
            syncing = self._armed and bool(self.should_sync())
        self.launcher.reset()
        self.store.begin_backward(syncing)
        if not syncing:
            self._mark_unsynced()
            return
        for i in self._begin_sync(it):
            self._mark_ready(i, from_hook=False)

    def _begin_sync(self, it: IterationState) -> list[int]:
        """Start a synced backward's state and header; return the parameters it will not produce."""
        n = len(self.params)
        it.syncing, it.ready, it.hook_counts = True, [False] * n, [0] * n
        for b in self.store.buckets:
            b.pending, b.handle, b.copied = len(b.members), None, 0
        if self.broken is None:
            self.plane.launch_header(BACKWARD)  # checked before the first bucket launches
        self.layout.begin_sync()
        it.divide, it.static = self.launcher.divides_on_copy, self.config.static_graph
        it.order = self.layout.ready_order
        if self.trace is not None:
            it.record = {"iteration": self.counters.sync, "backward_start": time.perf_counter(), "buckets": []}
        self.skips.plan(self.store.buckets, self._may_skip())
        return self.expected.unused(n, self.config)

    def _mark_ready(self, i: int, from_hook: bool = True, hooked: bool = False) -> None:
        """``hooked``: called from the gradient's hook (its time may be the backward's last gradient's)."""
        it = self.it
        # without static_graph, ready_now only refuses a second gradient: not called for a first one
        if (it.static or it.ready[i]) and not self.expected.ready_now(i, from_hook, it.ready, it.hook_counts,
                                                                      self.config, self.names[i]):
            if hooked:
                it.t_ready = time.perf_counter()
            return
        it.ready[i] = True
        store = self.store
        store.copy_in(i, it.divide)
        bucket = store.buckets[store.bucket_of[i]]
        bucket.pending -= 1
        if bucket.pending == 0:
            if hooked:  # timed per bucket, not per gradient: the backward's last gradient completes its bucket
                it.t_ready = time.perf_counter()
            if it.record is not None:
                bucket.times = {"ready": time.perf_counter()}
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch every bucket whose members are ready, strictly in index order."""
        if self.broken is not None:
            return
        try:
            self._launch_in_order()
        except PeerFailure as exc:
            if self.membership is None:
                raise
            self.break_group(exc)  # the backward goes on locally: the window's gradients stay whole

    def _launch_in_order(self) -> None:
        it, buckets = self.it, self.store.buckets
        if self.plane.header_pending and buckets[it.next_launch].pending == 0:
            # before the first bucket, which must pair with a bucket everywhere; blocking here costs
            # at most one small all-reduce's latency per synced backward, hidden when the first
            # bucket fills later than that after the backward's first gradient
            start = time.perf_counter()
            self.plane.check_header()
            it.hook_wait += time.perf_counter() - start
        while it.next_launch < len(buckets) and buckets[it.next_launch].pending == 0:
            if self.measure_norm:  # before the collective changes the buffer
                # one pass, no temporary: a bucket is up to 25 MiB
                part = torch.linalg.vector_norm(buckets[it.next_launch].buffer.detach(), dtype=torch.float32).square()
                it.norm2 = part if it.norm2 is None else it.norm2 + part
            if it.next_launch not in self.skips.skipped:  # the same buckets on every rank (skip.py)
                self.launcher.launch(buckets[it.next_launch], buckets, it.record is not None)
            it.next_launch += 1

    def drop_window(self) -> None:
        """Forget this rank's local gradients since the last synced backward (a failed backward's
        partial gradients among them): the next synced backward reduces nothing of them."""
        self._reset_iteration()
        self.store.drop_local()
        self.window_used = [False] * len(self.params)

    def sync_without_backward(self) -> None:
        """Take part in the other ranks' synced backward with this rank's window so far, as if its own
        backward produced no new gradient (a skipped micro-step: ``standin.py``); counters as set."""
        self.it = it = IterationState(in_backward=True)
        unused = set(self._begin_sync(it))
        for i in range(len(self.params)):
            self._mark_ready(i, from_hook=i not in unused)
        self._finalize()

    # ---------------------------------------------------------------- end of backward
    def _finalize(self) -> None:
        try:
            if self.it.syncing:
                self._finish_sync()
        except Exception as exc:
            self.last_error = messages.logged(exc)  # _get_ddp_logging_data()["error"], as torch's logger
            raise
        finally:
            self.it.in_backward = self.it.syncing = False

    def fail_sync(self, again: bool = True) -> None:
        """This rank's synced backward failed part-way: send its buckets anyway, flagged in the control,
        so that every rank reduces again without this rank's window (``standin.reduce_again_without``);
        ``again=False``: that would not be exact, every rank raises."""
        try:
            self._finish_sync(failed=1 if again else 2)
        finally:
            self.it.in_backward = self.it.syncing = False

    def _finish_sync(self, failed: int = 0) -> None:
        # elastic (membership.py): nothing is written back before every member voted that it holds the
        # reduction; otherwise the survivors re-form and reduce their own windows again
        self._complete(*(self._reduce(failed) if self.membership is None else membership.finish_sync(self, failed)))

    def _reduce(self, failed: int) -> tuple[list[Any] | None, list[int], dict | None]:
        """Launch what is left, wait for every bucket and the control, run the checks; return the
        buckets' results, the used counts and the trace record (nothing is written back yet)."""
        it, store, n = self.it, self.store, len(self.params)
        if self.config.static_graph and self.expected.static_counts is None:
            self.expected.static_counts = list(it.hook_counts)
            for i in range(n):
                it.ready[i] = True
                store.copy_in(i, self.launcher.divides_on_copy)
            for b in store.buckets:
                b.pending = 0
        if it.hooked is None:
            it.hooked = list(it.ready)
        ready_in_hooks = it.hooked
        missing = [i for i in range(n) if not ready_in_hooks[i]]
        graph_changed = self.config.static_graph and bool(missing)
        for i in range(n):  # launch every bucket anyway so peers are not left waiting
            if not it.ready[i]:
                self._mark_ready(i, from_hook=False)
        self._launch_ready()
        if self.broken is not None:
            raise self.broken

        tracks_unused = self.config.find_unused_parameters or self.config.static_graph
        c = self.counters
        used = self.window_used if tracks_unused else [True] * n if failed else ready_in_hooks
        ready = it.t_ready or time.perf_counter()
        results = None  # the buckets first: the control then carries how long this rank waited for them
        if self.bucket_reduced is not None:  # overlap_optimizer: write back and step bucket by bucket
            self._write_back_as_reduced()
        else:
            results = self.skips.results(self.launcher, store.buckets)
        self.launcher.before_control([b.handle for b in store.buckets])
        # its own work, and every wait on the others: in its hooks (the header) and after its last gradient
        times = ((ready - self._forward_end - it.hook_wait) * 1e6, (time.perf_counter() - ready + it.hook_wait) * 1e6)
        norm2 = local_norm2(self) if self.measure_norm else None
        control = control_tensor(self.rank, self.world_size, c.backward, c.forward, used, self.plane.device, failed,
                                 (max(times[0], 0), times[1]), norm2)
        self.plane.wait(self.plane.launch_control(control), "the end-of-backward check")
        control = control.cpu()  # read once: every check below indexes it
        active = self.plane.active()
        check_agreement(control, rank=self.rank, world_size=self.world_size, n=n, active=active, sync_count=c.sync)
        record_report(self, control, active)
        counts = used_counts(control, self.world_size, n)
        flags = failed_ranks(control, self.world_size, n)
        self.failed_ranks = sorted(flags)
        if flags:  # a rank's backward failed part-way: reduce again without its window
            results = standin.reduce_again_without(self, flags)
        results = self.skips.after_control(self, counts, results, self._may_skip())
        if self.config.check_finite and results is not None and not store.sharded:
            check_finite(results, [b.members for b in store.buckets], self.params, self.names)
        if graph_changed:
            raise RuntimeError(messages.static_graph_missing(", ".join(self.names[i] for i in missing), self.rank,
                                                             " ".join(map(str, missing))))
        if not tracks_unused:
            check_missing(counts, self.names, len(active))
        return results, counts, it.record

    def _complete(self, results: list[Any] | None, counts: list[int], record: dict | None) -> None:
        """Write every bucket's average back and close the synced backward."""
        store, n, c = self.store, len(self.params), self.counters
        for bucket, result in zip(store.buckets, results or ()):
            store.write_back(bucket, result, counts)
        store.end_sync()
        if record is not None:
            self._record_trace(record)
        self.window_used = [False] * n
        guard.mark_synced(self)
        c.sync += 1
        self.layout.after_sync(record)  # re-plans once from the observed order; "auto" times it

    # ---------------------------------------------------------------- elastic membership (membership.py)
    def break_group(self, failure: BaseException) -> None:
        """Stop using the group until this window's synced backward re-forms it; tell the others."""
        if self.broken is None:
            self.broken = failure
            self.plane.drop_header()
            self.membership.broken(failure)

    def regroup(self, group: dist.ProcessGroup) -> None:
        """Reduce over ``group`` from now on (the survivors' new group, or a joiner's first)."""
        membership.regroup(self, group)

    def after_shadowed_sync(self) -> None:
        """A joined rank took part in the active ranks' synced backward (``join.py``)."""
        self.counters.sync += 1
        self.layout.after_sync(None, shadowed=True)

    def _write_back_as_reduced(self) -> None:
        """Write back each bucket as soon as it is reduced and hand it to ``bucket_reduced``; the
        checks come after: a failing one raises on every rank, these buckets already stepped (overlap.py)."""
        everyone = [self.world_size] * len(self.params)  # find_unused_parameters is refused there
        for b in self.store.buckets:
            result = self.launcher.result(b)
            if self.config.check_finite:
                check_finite([result], [b.members], self.params, self.names)
            self.store.write_back(b, result, everyone)
            for i in b.members:
                self.window_used[i] = False  # synced now: the step guard lets the step through
            self.bucket_reduced(b.members)

    def _record_trace(self, record: dict) -> None:
        record["backward_end"] = time.perf_counter()
        if self.last_report is not None:  # every rank's own work and waits (export_trace draws them)
            record["ranks"] = {r: (v.compute_ms, v.wait_ms) for r, v in self.last_report.ranks.items()}
        for b in self.store.buckets:
            record["buckets"].append({"index": b.index, "bytes": self.store.nbytes(b), **b.times})
        self.trace.append(record)
        self.it.record = None

    # ---------------------------------------------------------------- bookkeeping
    def _reset_iteration(self) -> None:
        self.it = IterationState()
        self.plane.drop_header()
        self.launcher.reset()
        self.store.reset()

    def _may_skip(self) -> bool:
        """Whether skip_all_reduce_unused_params may skip now: the same on every rank (skip.py)."""
        return self.bucket_reduced is None and self.plane.active_ranks is None

    def _mark_unsynced(self) -> None:
        if self.world_size > 1:  # on one rank every gradient is already the global one
            guard.mark_unsynced(self)

    def unsynced_params(self) -> list[int]:
        """Indices of parameters holding gradients from backwards since the last synced one."""
        return [i for i, used in enumerate(self.window_used) if used and self.store.has_local_grad(i)]

    def check_foreign_step(self, optimizer: Any) -> None:
        self.store.check_foreign_step(optimizer)

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.store.release()
        guard.forget(self)


def _hook(reducer: weakref.ref, i: int) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        me = reducer()
        if me is not None:  # once the wrapper is gone, its parameters train locally
            me.on_grad_ready(i, param)
    return hook


__all__ = ["IterationState", "Reducer"]
