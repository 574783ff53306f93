"""The end of a synced backward: wait for the buckets, check the control, write back.

``SyncEnd`` is the part of the reducer that runs once the autograd engine finished a synced
backward (its queued callback, or the last bucket's launch under compiled autograd): every bucket
is launched, the control all-reduce of ``control.py`` follows, and only when every rank agrees
are the averages written back into ``.grad``. With ``bucket_reduced`` set (``overlap_optimizer``)
each bucket is written back and handed over as soon as it is reduced, before the checks.
"""
from __future__ import annotations

from . import guard
from .control import check_agreement, check_finite, check_missing, control_tensor, used_counts


class SyncEnd:
    def _finalize(self) -> None:
        try:
            if self._syncing:
                self._finish_sync()
        finally:
            self._in_backward = False
            self._syncing = False

    def _finish_sync(self) -> None:
        n = len(self.params)
        if self.static_graph and self._static_counts is None:
            self._static_counts = list(self._hook_counts)
            for i in range(n):
                self._ready[i] = True
                self._copy_to_bucket(i)
            for b in self.buckets:
                b.pending = 0
        ready_in_hooks = list(self._ready)
        missing = [i for i in range(n) if not ready_in_hooks[i]]
        graph_changed = self.static_graph and bool(missing)
        for i in missing:  # launch every bucket anyway so peers are not left waiting
            self._mark_ready(i, from_hook=False)
        self._launch_ready_buckets()

        tracks_unused = self.find_unused_parameters or self.static_graph
        used = self._window_used if tracks_unused else ready_in_hooks
        control = control_tensor(self.rank, self.world_size, self.backward_count, self.forward_count, used,
                                 self.device)
        control_work = self.launch_control(control, [b.handle for b in self.buckets])

        if self.bucket_reduced is not None:  # overlap_optimizer: write back and step bucket by bucket
            results = None
            self._write_back_as_reduced()
        else:
            results = [self._wait_bucket(b) for b in self.buckets]
        self.wait(control_work, "the end-of-backward check")
        control = control.cpu()  # read once: every check below indexes it
        active = self.active_ranks if self.active_ranks is not None else range(self.world_size)
        check_agreement(control, rank=self.rank, world_size=self.world_size, n=n, active=list(active),
                        sync_count=self.sync_count)
        counts = used_counts(control, self.world_size, n)
        if self.check_finite and results is not None:
            check_finite(results, [b.members for b in self.buckets], self.params, self.names)
        if graph_changed:
            names = ", ".join(self.names[i] for i in missing)
            raise RuntimeError(
                f"gradsync: static_graph=True, but parameter(s) {names} produced no gradient in this "
                "backward although they did in the first iteration. The graph changed; construct the "
                "model with static_graph=False (and find_unused_parameters=True if needed)."
            )
        if not tracks_unused:
            check_missing(counts, self.names, len(active))

        for bucket, result in zip(self.buckets, results or ()):
            self._write_back(bucket, result, counts)
        record = self._iter_trace
        if record is not None:
            self._record_trace()
        self._window_used = [False] * n
        guard.mark_synced(self)
        self.sync_count += 1
        if self._ready_order is not None:
            self._rebuild_buckets()
        if self.auto_caps is not None and self.auto_caps.choice is None:
            self.auto_caps.observe(self, record)

    def _write_back_as_reduced(self) -> None:
        """Write back each bucket as soon as it is reduced and hand it to ``bucket_reduced``.

        The end-of-backward checks come after: a failing one raises on every rank, with these
        buckets already stepped (see ``layers/overlap.py``).
        """
        everyone = [self.world_size] * len(self.params)  # find_unused_parameters is refused there
        for b in self.buckets:
            result = self._wait_bucket(b)
            if self.check_finite:
                check_finite([result], [b.members], self.params, self.names)
            self._write_back(b, result, everyone)
            for i in b.members:
                self._window_used[i] = False  # synced now: the step guard lets the step through
            self.bucket_reduced(b.members)
