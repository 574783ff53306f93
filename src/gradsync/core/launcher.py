"""Bucket launches in index order, through the default all-reduce or a comm hook; bounded waits.

``BucketLauncher`` is the part of the reducer that talks to the process group. Buckets launch
strictly in index order on every rank, so collectives pair up across ranks even when gradients
become ready in different orders. It expects the reducer's ``buckets``, ``params``, ``group``,
``world_size``, ``comm_hook``/``comm_state``, ``timeout`` and trace state.
"""
from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from ._torch import is_future
from .comm import GradBucket, issues_one_collective
from .control import SyncError, bounded_wait
from .header import check_header, header_tensor, payloads
from .storage import Bucket


class BucketLauncher:
    _header: torch.Tensor | None = None
    _header_work: Any = None
    phase_headers = True  # False only to measure what they cost (benchmarks/header_cost.py)
    # Set before a synced backward to send a float in that backward's header (consumed by the
    # launch); afterwards ``header_payloads`` holds every rank's, and None when no header ran.
    header_payload: float | None = None
    header_payloads: list[float] | None = None

    def launch_header(self, kind: int) -> None:
        """Start this phase's header all-reduce (``header.py``); ``kind=0`` shadows as a joined rank."""
        payload, self.header_payload = self.header_payload or 0.0, None
        self.header_payloads = None
        if self.world_size > 1 and self.phase_headers:
            self._header = header_tensor(self.rank, self.world_size, kind, self.forward_count,
                                         self.backward_count, self.device, payload)
            self._header_work = dist.all_reduce(self._header, group=self.group, async_op=True)

    def check_header(self) -> None:
        """Wait for the pending header; raise on every rank unless all are in the same phase."""
        work, self._header_work = self._header_work, None
        if work is None:
            return
        self.wait(work, "the phase header")  # a slow rank is fine: this waits the usual bound
        active = self.active_ranks if self.active_ranks is not None else range(self.world_size)
        check_header(self._header, rank=self.rank, active=list(active))
        self.header_payloads = payloads(self._header)

    def exchange_header(self, kind: int) -> None:
        """Run a header to completion before a phase whose first collective must pair (a broadcast)."""
        self.launch_header(kind)
        self.check_header()

    def _launch_ready_buckets(self) -> None:
        buckets = self.buckets
        if self._header_work is not None and buckets[self._next_launch].pending == 0:
            # before the first bucket, which must pair with a bucket everywhere; blocking here costs
            # at most one small all-reduce's latency per synced backward, hidden when the first
            # bucket fills later than that after the backward's first gradient
            self.check_header()
        while self._next_launch < len(buckets) and buckets[self._next_launch].pending == 0:
            self._launch(buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        tracing = self._iter_trace is not None
        if tracing:
            bucket.times["launch"] = time.perf_counter()
        previous = self.buckets[bucket.index - 1].handle if bucket.index else None
        bucket.handle = self.issue(bucket.index, bucket.buffer, bucket.views, bucket.members, previous)
        if tracing:
            fut = bucket.handle if is_future(bucket.handle) else bucket.handle.get_future()
            times = bucket.times
            fut.add_done_callback(lambda _f: times.__setitem__("done", time.perf_counter()))

    def issue(self, index: int, buffer: torch.Tensor, views: list[torch.Tensor], members: list[int],
              previous: Any) -> Any:
        """Start bucket ``index``'s collective: the default all-reduce, or the comm hook's future.

        ``previous`` is the handle of bucket ``index - 1``; a hook not known to issue a single
        collective waits for it first (see ``comm.issues_one_collective``).
        """
        if self.comm_hook is None:
            return dist.all_reduce(buffer, group=self.group, async_op=True)
        if previous is not None and not issues_one_collective(self.comm_hook):
            self.wait(previous, f"bucket {index - 1} (its hook's collectives finish before bucket {index})")
        if buffer.is_complex():  # as torch's reducer: hooks see the real view (a cast would drop imaginary parts)
            buffer, views = torch.view_as_real(buffer).view(-1), [torch.view_as_real(v) for v in views]
        handle = self.comm_hook(self.comm_state, GradBucket(index, buffer, views, [self.params[i] for i in members],
                                                            index == len(self.buckets) - 1))
        if not is_future(handle):
            raise TypeError(
                f"gradsync: the communication hook returned {type(handle).__name__} for bucket {index}; "
                "it must return a torch.futures.Future of the reduced tensor"
            )
        return handle

    def launch_control(self, control: torch.Tensor, handles: list[Any]) -> dist.Work:
        """All-reduce the end-of-backward control after the buckets' collectives.

        With a hook that may issue collectives from its futures' callbacks, wait for every
        bucket's future first, so the control pairs with the control on every rank.
        """
        if self.comm_hook is not None and not issues_one_collective(self.comm_hook):
            for index, handle in enumerate(handles):
                self.wait(handle, f"bucket {index}")
        return dist.all_reduce(control, group=self.group, async_op=True)

    def _wait_bucket(self, bucket: Bucket) -> torch.Tensor:
        handle = bucket.handle
        self.wait(handle, f"bucket {bucket.index}")
        if not is_future(handle):
            return bucket.buffer
        result = handle.value()
        if isinstance(result, (list, tuple)) and len(result) == 1:
            result = result[0]
        if bucket.buffer.is_complex() and isinstance(result, torch.Tensor) and not result.is_complex() \
                and result.dtype == bucket.buffer.real.dtype and result.numel() == 2 * bucket.buffer.numel():
            result = torch.view_as_complex(result.reshape(-1, 2))  # the hook reduced the real view
        if not isinstance(result, torch.Tensor) or result.numel() != bucket.buffer.numel():
            what = (f"a tensor of {result.numel()} elements" if isinstance(result, torch.Tensor)
                    else type(result).__name__)
            raise TypeError(
                f"gradsync: the communication hook's future for bucket {bucket.index} yielded {what}; "
                f"expected a tensor of {bucket.buffer.numel()} elements (the bucket's buffer)"
            )
        if result.dtype != bucket.buffer.dtype:
            raise TypeError(
                f"gradsync: the communication hook's future for bucket {bucket.index} yielded a "
                f"{result.dtype} tensor; expected {bucket.buffer.dtype} (the bucket's dtype). A "
                "compressing hook must decompress into the bucket's dtype before returning."
            )
        return result

    def wait(self, handle: Any, what: str) -> None:
        """Wait for a Work or Future, bounded by ``self.timeout``, with a useful error."""
        try:
            bounded_wait(handle, self.timeout)
        except Exception as exc:
            raise SyncError(
                f"gradsync: rank {self.rank} waited for {what} of synced backward {self.sync_count} "
                f"(backward {self.backward_count} on this rank) and it failed or did not finish within "
                f"{self.timeout.total_seconds():g}s: {exc}. Likely cause: another rank died, raised, "
                "skipped a backward, ran a different number of micro-steps, or disagreed about no_sync."
            ) from exc

    def _record_trace(self) -> None:
        it = self._iter_trace
        it["backward_end"] = time.perf_counter()
        for b in self.buckets:
            it["buckets"].append({"index": b.index, "bytes": self._bucket_nbytes(b), **b.times})
        self.trace.append(it)
        self._iter_trace = None
