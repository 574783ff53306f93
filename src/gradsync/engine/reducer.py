"""The reducer: one synced backward, from a gradient's hook to the averaged ``.grad``.

It knows parameters, buckets and a process group: nothing of modules, optimizers or the features above.
Parts: ``store`` (bucket memory), ``launcher`` (a bucket's collective), ``plane`` (``control.py``), ``it`` (what this
backward has seen). The trip: a gradient's hook counts it into its bucket (``register_grad_ready``, inline in the
hook); a full bucket copies its gradients in and starts its collective, in index order on every rank
(``start_grad_sync``); the end-of-backward callback runs ``finish_grad_sync``: ``reduce`` launches the control, waits
for the buckets and it, checks it; ``commit`` writes the averages back. A commit protocol attaches (``protocol.attach``).
"""
from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from . import messages, quiet, telemetry
from .._torch import in_compiled_autograd, queue_end_of_backward
from .autocap import AutoCaps
from .config import ReducerConfig
from .control import BACKWARD, ControlPlane, Counters
from .groups import control_group
from .graph import Expected, inner_backward_ended
from .iteration import IterationState
from .launcher import BucketLauncher
from .layout import Layout
from .errors import PeerFailure
from .replay import reduce_again_without
from .replicas import ReplicaCheck
from .checks import check_finite
from .store import Bucket, BucketStore
from .unused import UnusedBuckets


class Reducer:
    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str], process_group: dist.ProcessGroup,
                 config: ReducerConfig, *, switch: Any, store: Any = None,
                 launcher: Callable[[ControlPlane], Any] | None = None):
        """``switch.require_backward_grad_sync`` is read at each backward; ``store`` and ``launcher`` (given the plane)."""
        self.params, self.names, self.config = list(params), list(names), config
        self.group, self.rank, self.world_size = process_group, dist.get_rank(process_group), dist.get_world_size(process_group)
        self.device, self.switch = self.params[0].device, weakref.ref(switch)  # the data plane's device
        self.backward_check, self.counters = None, Counters()  # backward_check: model.join()'s look at the sync flag
        group, device = control_group(process_group, self.device)  # off CPU, a CPU group: no host syncs
        self.plane = ControlPlane(group, rank=self.rank, world_size=self.world_size, device=device,
                                  timeout=config.timeout, counters=self.counters, data_device=self.device)
        self.store = store or BucketStore(self.params, self.names, world_size=self.world_size, caps=config.caps,
                                          reduce_dtype=config.reduce_dtype, gradient_as_bucket_view=config.gradient_as_bucket_view)
        self.launcher = launcher(self.plane) if launcher else BucketLauncher(process_group, self.plane, self.params)
        self.it, self.trace = IterationState(), None  # trace: [] records a timeline per synced backward (enable_trace)
        self.bucket_reduced, self.window_apart = None, False  # overlap_optimizer's step per bucket; keep_window_apart
        self.index_of = {id(p): i for i, p in enumerate(self.params)}
        self.window_used, self.unsynced = [False] * len(self.params), False  # used since the last sync; guard.py reads both
        self.failed_ranks, self.attached = [], None  # whose last synced backward failed (replay.py); protocol.attach's
        self.last_report, self.measure_norm, self.local_norms = None, False, None  # SyncReport; {rank: local norm^2}
        self.stragglers = telemetry.Stragglers() if config.straggler_warning else None
        self.plane.replicas = ReplicaCheck(self.store, self.names, config.check_replicas) if config.check_replicas else None
        self.expected = Expected(self.index_of)  # graph.py: unused parameters, static_graph's counts
        self.finite_check = partial(check_finite, params=self.params, names=self.names) if config.check_finite else None
        self.skips = UnusedBuckets(config.skip_all_reduce_unused_params)  # unused.py: buckets no rank uses
        self.last_error, self.warned_ignored = None, False  # torch's logger keeps the latest error
        self.layout = Layout(self.store, self.plane, process_group, config)
        self.layout.auto = self.auto_caps = AutoCaps(config.user_first_bucket_cap_mb, self) if config.auto_bucket_cap else None
        me = weakref.ref(self)  # the hooks hold the reducer weakly: parameters outlive a deleted wrapper
        self.handles = [p.register_post_accumulate_grad_hook(_hook(me, i)) for i, p in enumerate(self.params)]
        self.quiet = quiet.QuietHooks(self.params, self.handles)

    buckets = property(lambda self: self.store.buckets)
    sync_count = property(lambda self: self.counters.sync)
    backward_count = property(lambda self: self.counters.backward)
    is_sharded = property(lambda self: self.store.sharded)
    tracks_graph = property(lambda self: self.config.find_unused_parameters or self.config.static_graph)
    bucket_plan = property(lambda self: self.store.plan)  # () -> the buckets as lists of parameter indices
    wait = property(lambda self: self.plane.wait)  # (handle, what): bounded by the timeout
    # skip_all_reduce_unused_params may skip now: the same on every rank
    may_skip = property(lambda self: self.bucket_reduced is None and self.plane.active_ranks is None)

    def on_bucket_reduced(self, callback: Callable[[list[int]], None] | None) -> None:  # overlap.py
        self.bucket_reduced = callback  # each bucket is written back as soon as reduced, then callback(members)

    enable_trace = telemetry.enable_trace  # (on=True) -> the timeline list; on=False stops recording

    def prepare_for_forward(self) -> None:
        # the last backward raised before its end: drop its state; not at a no-grad forward, which may run in another
        # thread while a backward runs in this one
        if (unfinished := self.it).in_backward and torch.is_grad_enabled():
            if unfinished.syncing and unfinished.compiled_autograd:
                raise RuntimeError(messages.COMPILED_AUTOGRAD_UNFINISHED)
            self.reset_iteration()
            if unfinished.syncing and self.config.static_graph:  # as torch: the graph broke its promise
                self.expected.refuse_unfinished(unfinished.hook_counts, self.names, self.rank)

    def prepare_for_backward(self, outputs: Any, training: bool = True, sync: bool = True) -> None:
        """A backward may follow; ``sync`` is the forward's wish (the switch is read again at backward)."""
        self.counters.note_forward(training, sync)
        self.quiet.keep_last(self.store)  # after the forward: a hook the module registered in it runs before ours
        if self.tracks_graph:
            self.expected.note_forward(outputs, self.config)

    def on_grad_ready(self, i: int, param: torch.Tensor) -> None:  # the hook of parameter i, when not inline
        it = self.it
        if not it.in_backward:
            it = self.begin_backward()
        if param.grad is not None:  # autograd may leave it undefined: that is not a use (torch agrees)
            self.window_used[i] = True
        if not it.syncing:
            self.store.local_ready(i) if it.fast and it.adopt else self.store.keep_local(i)
            return
        if it.order is not None:  # the first synced backward's order (layout.py)
            it.order.append(i)
        self.register_grad_ready(i, hooked=True)
        if it.compiled_autograd and it.next_launch == len(self.store.buckets):
            self.finish_grad_sync()  # the last bucket launched: compiled autograd never runs queued callbacks

    def begin_backward(self) -> IterationState:
        compiled = in_compiled_autograd()
        self.it = it = IterationState(in_backward=True, compiled_autograd=compiled)
        if not compiled:
            queue_end_of_backward(self.finish_grad_sync)
        syncing, c = False, self.counters
        if not c.take_backward():  # no forward of the wrapper prepared it: local, as in torch
            if not self.warned_ignored:  # its gradients are reduced at the next synced backward
                self.warned_ignored = True
                warnings.warn(messages.UNPREPARED_BACKWARD, stacklevel=3)
        else:
            switch = self.switch()
            syncing = c.armed and switch is not None and bool(switch.require_backward_grad_sync)
            if self.backward_check is not None:
                self.backward_check(syncing)
        self.launcher.reset()
        self.store.begin_backward(syncing)
        if not syncing or compiled:
            self.unsynced = self.world_size > 1  # until a synced backward ends: no optimizer step before
        if syncing:
            for i in self.start_sync(it):
                self.register_grad_ready(i, from_hook=False)
        it.adopt, local = self.store.adopts_views, not self.store.keeps_local_per_grad  # the hooks' own path (_hook)
        it.fast = not compiled and (it.per_bucket and not it.checked and it.order is None if syncing else local)
        if it.fast and not syncing and not self.tracks_graph and self.quiet.mute(self.store if it.adopt else None):
            self.window_used = [True] * len(self.params)  # what the hooks would mark: the guard asks has_local_grad
        return it

    def start_sync(self, it: IterationState) -> list[int]:
        """Start a synced backward's state and header; return the parameters it will not produce."""
        it.syncing, it.ready, it.hook_counts = True, [False] * (n := len(self.params)), [0] * n
        self.store.begin_sync()
        if self.attached is None or self.attached.broken is None:
            self.plane.launch_header(BACKWARD)  # checked before the first bucket launches
        if not self.layout.rebuilt:
            self.layout.begin_sync()
            it.order = self.layout.ready_order
        it.divide, it.checked, it.per_bucket = self.launcher.divides_on_copy, self.config.static_graph, self.store.copies_per_bucket
        if self.trace is not None:
            it.record = {"iteration": self.counters.sync, "backward_start": time.perf_counter(), "buckets": []}
        if self.skips.enabled:
            self.skips.plan(self.store.buckets, self.may_skip)
        if self.tracks_graph:  # a window's gradient that zero_grad() dropped since is no use: .grad stays None
            self.window_used = [u and self.store.has_local_grad(i) for i, u in enumerate(self.window_used)]
        return self.expected.unused(n, self.config) if self.tracks_graph else []

    def register_grad_ready(self, i: int, from_hook: bool = True, hooked: bool = False) -> None:
        """Parameter ``i``'s gradient is final: copy it into its slot; a full bucket starts its sync."""
        it = self.it
        if (it.checked or it.ready[i]) and not self.expected.ready_now(i, from_hook, it.ready, it.hook_counts,
                                                                       self.config, self.names[i]):
            if hooked:
                it.t_ready = time.perf_counter()
            return
        it.ready[i] = True
        if not it.per_bucket:  # a store that takes each gradient as it is ready (sharded, reduce_dtype)
            self.store.copy_in(i, it.divide)
        bucket = self.store.buckets[self.store.bucket_of[i]]
        bucket.pending -= 1
        if bucket.pending == 0:
            self.bucket_ready(bucket, hooked)

    def bucket_ready(self, bucket: Bucket, hooked: bool = True) -> None:
        """Every member of ``bucket`` is in: copy the bucket's gradients in (per bucket) and start syncs."""
        if hooked:  # timed per bucket: the backward's last gradient completes its bucket
            self.it.t_ready = time.perf_counter()
        if (it := self.it).per_bucket:
            self.store.copy_in_bucket(bucket, it.divide)
        if it.record is not None:
            bucket.times = {"ready": time.perf_counter()}
        self.start_grad_sync()

    def start_grad_sync(self) -> None:
        """Launch every bucket whose members are ready, strictly in index order."""
        if self.attached is not None and self.attached.broken is not None:
            return
        it, buckets, waited = self.it, self.store.buckets, self.launcher.waited
        try:
            if self.plane.work is not None and buckets[it.next_launch].pending == 0:
                # the header pairs before the first bucket: at most one small all-reduce's latency, hidden mostly
                start = time.perf_counter()
                self.plane.check_header()
                self.launcher.waited += time.perf_counter() - start
            while it.next_launch < len(buckets) and buckets[it.next_launch].pending == 0:
                bucket = buckets[it.next_launch]
                if self.measure_norm:  # before the collective changes the buffer
                    it.norm2 = telemetry.add_norm2(it.norm2, bucket.buffer)
                if it.next_launch not in self.skips.skipped:  # the same buckets on every rank (unused.py)
                    self.launcher.launch(bucket, buckets, it.record is not None)
                it.next_launch += 1
        except PeerFailure as exc:  # only with a protocol: the backward goes on locally, the window stays whole
            self.attached.lose_group(exc)
        if waited := self.launcher.waited - waited:  # the header's, a hook's: others' work, after the gradient that launched
            it.hook_wait, it.t_ready = it.hook_wait + waited, it.t_ready and it.t_ready + waited

    def finish_grad_sync(self, failed: int = 0) -> None:
        """The end of backward: reduce, then commit (with a protocol: once every member holds it)."""
        if self.it.syncing and self.it.next_launch < len(self.store.buckets) and inner_backward_ended(self):
            return  # a reentrant checkpoint's backward, nested in the one that goes on (graph.py)
        try:
            if self.it.syncing:  # with a protocol: reduced until every member holds it
                self.commit(*(self.reduce(failed) if self.attached is None else self.attached.reduce_until_committed(failed)))
            elif self.it.adopt and (self.quiet.fresh or not self.quiet.muted):  # with views: a .grad not its view
                self.store.adopt_views()  # is taken in, in the buckets this backward left incomplete
        except Exception as exc:
            self.last_error, self.unsynced = messages.logged(exc), self.world_size > 1  # torch's log; guard.py: no step
            raise
        finally:
            self.it.in_backward = self.it.syncing = self.it.fast = False
            if self.quiet.muted:  # a local backward's hooks, taken out after its first (quiet.py)
                self.quiet.unmute()

    def reduce(self, failed: int = 0) -> tuple[list[Any] | None, list[int], dict | None]:
        """Launch what is left, wait for the buckets and the control, check it; write nothing back yet."""
        it, store, n, config = self.it, self.store, len(self.params), self.config
        if config.static_graph and self.expected.static_counts is None:  # learned: every gradient is in now
            self.expected.static_counts, it.ready = list(it.hook_counts), [True] * n
            store.copy_in_all(self.launcher.divides_on_copy)
        it.hooked = list(it.ready) if it.hooked is None else it.hooked
        missing = [i for i in range(n) if not it.hooked[i]]
        for i in range(n):  # launch every bucket anyway so peers are not left waiting
            if not it.ready[i]:
                self.register_grad_ready(i, from_hook=False)
        self.start_grad_sync()
        if self.attached is not None and self.attached.broken is not None:
            raise self.attached.broken
        used, ready = self.window_used if self.tracks_graph else [True] * n if failed else it.hooked, it.t_ready or time.perf_counter()
        self.launcher.before_control([b.handle for b in store.buckets])
        control = self.plane.send_control(used, failed, telemetry.local_norm2(self) if self.measure_norm else None)  # in flight beside them
        if self.bucket_reduced is not None and self.attached is None and not self.window_apart:  # overlap_optimizer: step each as reduced
            everyone = [c * p.requires_grad for c, p in zip(self.expected.everyone(n, self.world_size), self.params)]
            results = store.write_back_as_reduced(self.launcher, everyone, self.finite_check, self.bucket_done)
        else:  # every bucket's, or a skipped one's own buffer (unused.py, only when enabled: off the trip)
            results = self.skips.results(self.launcher, store.buckets) if self.skips.enabled else [
                self.launcher.result(b) for b in store.buckets]
        # its own work, and every wait on the others: in its hooks (the header) and after its last gradient
        times = (max((ready - self.counters.forward_end - it.hook_wait) * 1e6, 0), (time.perf_counter() - ready + it.hook_wait) * 1e6)
        verdict = self.plane.read_control(control, n, times, results)  # times ride in the next synced backward's
        telemetry.take_report(self, verdict, self.trace)
        self.local_norms = telemetry.local_norms(verdict) if self.measure_norm else None
        self.failed_ranks = sorted(verdict.failed)
        if verdict.failed:  # a rank's backward failed part-way: reduce again without its window
            results = reduce_again_without(self, verdict.failed)
        if self.skips.enabled:
            results = self.skips.after_control(self, verdict.counts, results, self.may_skip)
        self.skips.reduced = sum(b.handle is not None for b in store.buckets)  # torch's num_buckets_reduced
        if self.finite_check is not None and results is not None and not store.sharded:
            self.finite_check(results, [b.members for b in store.buckets])
        if config.static_graph and missing and not failed:  # a failed backward (replay.py) ran part of the graph
            raise self.expected.missing_error(missing, self.names, self.rank)
        if not self.tracks_graph:
            verdict.check_missing(self.names, self.params)
        if self.auto_caps is not None and self.auto_caps.due:  # every rank's timings, once, before the commit
            self.auto_caps.gather()
        return results, verdict.counts, it.record

    def commit(self, results: list[Any] | None, counts: list[int], record: dict | None) -> None:
        """Write every bucket's average back and close the synced backward."""
        self.store.end_sync(results, counts, self.bucket_done if self.bucket_reduced is not None else None)
        if record is not None:
            telemetry.record_trace(self.trace, record, self.store)
            self.it.record = None
        self.window_used, self.unsynced = [False] * len(self.params), False
        self.counters.sync += 1
        if self.layout.ready_order is not None or self.layout.auto is not None:
            self.layout.after_sync(record)  # re-plans once from the observed order; "auto" times it

    def bucket_done(self, members: list[int]) -> None:  # overlap_optimizer: written back before the control
        for i in members:
            self.window_used[i] = False  # synced now: the step guard lets the step through
        self.bucket_reduced(members)

    def reset_iteration(self) -> None:
        self.it = IterationState()
        self.quiet.unmute()
        self.plane.drop_header()
        self.launcher.reset()
        self.store.reset()

    def remove_hooks(self) -> None:
        self.quiet.release()
        for h in self.handles:
            h.remove()
        self.handles = []
        self.store.release()


def _hook(reducer: weakref.ref, i: int) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        me = reducer()  # None once the wrapper is gone: its parameters train locally
        it = me.it if me is not None else None
        if it is None or not it.fast or (it.syncing and it.ready[i]):
            return None if me is None else me.on_grad_ready(i, param)
        # register_grad_ready, inline: on many small parameters a call each was most of the hook
        if (grad := param.grad) is not None:
            me.window_used[i] = True
        if it.syncing:
            it.ready[i] = True
        elif not it.adopt:  # a local backward without views needs nothing per gradient
            return None
        bucket = (store := me.store).buckets[store.bucket_of[i]]
        if not it.syncing and grad is not None and (grad.layout is not torch.strided or grad.data_ptr() != store.view_ptrs[i]):
            bucket.fresh.append(i)  # autograd's fresh tensor, not its view: the complete bucket adopts it
        bucket.pending -= 1  # complete: a synced backward reduces it, a local one takes its .grad into its views
        if bucket.pending == 0:
            me.bucket_ready(bucket) if it.syncing else store.adopt_views([bucket])
    return hook


__all__ = ["Reducer"]
