"""What only the reducer sees: each rank's own backward time, its wait for the reduction, the slow rank.

Under DDP every rank waits for the slowest in the all-reduce, so timings taken from outside look
alike. The reducer knows when this rank's last gradient of a synced backward was ready (its own
work: from the forward's end, less the time its hooks waited on the phase header) and how long it
waited on the others (that header wait, then until every bucket was reduced). Each rank writes both
into its own slots of the next synced backward's control (``control.py``; the wait is known only once
the control has left, beside the buckets), and its local gradient's squared norm when asked
(``GradientAccumulator(noise_scale=True)``) into this one's: no extra collective, the same report on
every rank, one synced backward late.
"""
from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch


log = logging.getLogger("gradsync")


@dataclass(frozen=True)
class RankSync:
    """One rank's part of one synced backward."""

    compute_ms: float  # from its forward's end until its last gradient was ready, less its waits
    wait_ms: float  # waiting on the other ranks: its hooks' wait on the header, then until every bucket was reduced


@dataclass(frozen=True)
class SyncReport:
    """A synced backward as every rank saw it; the same on every rank."""

    sync: int
    ranks: dict[int, RankSync]
    slowest: int  # the rank whose gradients were ready last


def read_report(values: torch.Tensor, active: list[int], sync: int) -> SyncReport | None:
    """Build synced backward ``sync``'s report from the next control's telemetry slots (``Verdict.telemetry``):
    the active ranks that sent their times (None if none did)."""
    us = values.tolist()
    w = len(us) // 2
    ranks = {r: RankSync((us[r] - 1) / 1000.0, us[w + r] / 1000.0) for r in active if us[r] > 0}
    return SyncReport(sync, ranks, max(ranks, key=lambda r: ranks[r].compute_ms)) if ranks else None


class Stragglers:
    """Warn (once per episode) when one rank is the slowest in every one of the last ``WINDOW`` synced
    backwards and its own backward is clearly slower than the other ranks' (``RATIO`` and ``MIN_MS``:
    noise on a loaded machine does not reach both)."""

    WINDOW, RATIO, MIN_MS = 3, 1.5, 50.0

    def __init__(self) -> None:
        self.history: deque[SyncReport] = deque(maxlen=self.WINDOW)
        self.warned: int | None = None  # the rank of the episode in progress

    def forget(self) -> None:
        """The group re-formed: its ranks are other processes now."""
        self.history.clear()
        self.warned = None

    def observe(self, report: SyncReport) -> str | None:
        """Add a report; return the warning's text when an episode starts."""
        if len(report.ranks) < 2:
            return None
        self.history.append(report)
        slow = self._straggler()
        if slow is None:
            self.warned = None
            return None
        rank, mine, others = slow
        if self.warned == rank:
            return None
        self.warned = rank
        text = (f"gradsync: rank {rank} was the slowest in {self.WINDOW} of the last {self.WINDOW} synced "
                f"backwards: its backward took {mine:.0f} ms, the median rank's {others:.0f} ms. A straggler: "
                "every other rank waits for it in each all-reduce (see model.sync_report())")
        log.warning(text)
        return text

    def _straggler(self) -> tuple[int, float, float] | None:
        if len(self.history) < self.WINDOW or len({r.slowest for r in self.history}) != 1:
            return None
        rank = self.history[-1].slowest
        mine = statistics.median(r.ranks[rank].compute_ms for r in self.history)
        others = statistics.median(statistics.median(s.compute_ms for k, s in r.ranks.items() if k != rank)
                                   for r in self.history)
        if mine >= self.RATIO * others and mine - others >= self.MIN_MS:
            return rank, mine, others
        return None


def enable_trace(reducer: Any, on: bool = True) -> list[dict] | None:
    """Record a timeline per synced backward into the list returned (``on=False``: stop)."""
    reducer.trace = ([] if reducer.trace is None else reducer.trace) if on else None
    if on and reducer.auto_caps is not None:  # "auto" traces while it chooses: keep tracing after
        reducer.auto_caps.keep_trace()
    return reducer.trace


def add_norm2(total: Any, buffer: torch.Tensor) -> torch.Tensor:
    """Add a bucket's squared norm to ``total``: one pass over the bucket, no temporary."""
    wide = buffer.dtype.itemsize > 4 or buffer.is_complex()  # float64, complex: in their own precision
    part = torch.linalg.vector_norm(buffer.detach(), dtype=None if wide else torch.float32).square().float()
    return part if total is None else total + part


def local_norm2(reducer: Any) -> torch.Tensor:
    """The reducer's window gradient's squared norm, from what its buckets received (undone /W)."""
    total = reducer.it.norm2 if reducer.it.norm2 is not None else torch.zeros((), device=reducer.device)
    divided = reducer.launcher.divides_on_copy and not reducer.store.apart  # apart: the buffers are not divided
    return total * reducer.world_size ** 2 if divided else total


def record_report(verdict: Any, sync: int, stragglers: Stragglers | None, trace: list[dict] | None) -> SyncReport | None:
    """Read the previous synced backward's report (``sync``) from the reduced control; watch for a
    straggler, and give its record in the comm trace every rank's own work and waits."""
    report = read_report(verdict.telemetry()[0], verdict.active, sync)
    if report is not None and stragglers is not None:
        stragglers.observe(report)
    if report is not None and trace and trace[-1]["iteration"] == sync:  # its record, closed last: export_trace draws them
        trace[-1]["ranks"] = {r: (v.compute_ms, v.wait_ms) for r, v in report.ranks.items()}
    return report


def take_report(reducer: Any, verdict: Any, trace: list[dict] | None) -> None:
    """Keep the report the reduced control carried (the synced backward before it) as the reducer's latest."""
    reducer.last_report = record_report(verdict, reducer.counters.sync - 1, reducer.stragglers, trace) or reducer.last_report


def local_norms(verdict: Any) -> dict[int, float]:
    """Every active rank's local squared gradient norm, from this synced backward's control."""
    norms = verdict.telemetry()[1].tolist()
    return {r: norms[r] for r in verdict.active}


def record_trace(trace: list[dict], record: dict, store: Any) -> None:
    """Close a synced backward's comm trace record and append it to ``trace`` (its ranks' times come
    with the next synced backward's report: ``record_report``)."""
    record["backward_end"] = time.perf_counter()
    for b in store.buckets:
        record["buckets"].append({"index": b.index, "bytes": store.nbytes(b), **b.times})
    trace.append(record)


def chrome_trace(records_by_rank: list[list[dict]]) -> dict:
    """Every rank's comm trace as one Chrome trace (``chrome://tracing``, Perfetto): a process per rank
    with a row for the synced backward split into its own work and its waits, and a row for the buckets
    (launched to reduced). Ranks' clocks differ, so each synced backward is aligned on its end, which
    every rank reaches together (the reduction completes everywhere at once)."""
    events, anchors = [], {}  # each synced backward's end on the lowest rank that recorded it (a joined rank has fewer)
    for rank, records in enumerate(records_by_rank):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        for tid, name in ((0, "backward: own work / waits"), (1, "buckets: launched to reduced")):
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}})
        for rec in records:
            anchors.setdefault(rec["iteration"], rec["backward_end"])
    for rank, records in enumerate(records_by_rank):
        for rec in records:
            shift = anchors[rec["iteration"]] - rec["backward_end"]
            us = lambda t: round((t + shift) * 1e6, 1)  # noqa: E731
            end = us(rec["backward_end"])
            compute_ms, wait_ms = rec.get("ranks", {}).get(rank, (None, None))
            if compute_ms is not None:
                events.append({"ph": "X", "pid": rank, "tid": 0, "name": "own work", "ts": end - (compute_ms + wait_ms) * 1e3,
                               "dur": compute_ms * 1e3, "args": {"synced backward": rec["iteration"]}})
                events.append({"ph": "X", "pid": rank, "tid": 0, "name": "waiting on the others",
                               "ts": end - wait_ms * 1e3, "dur": wait_ms * 1e3, "args": {"synced backward": rec["iteration"]}})
            for b in rec["buckets"]:
                if "launch" in b and "done" in b:
                    events.append({"ph": "X", "pid": rank, "tid": 1, "name": f"bucket {b['index']}",
                                   "ts": us(b["launch"]), "dur": round((b["done"] - b["launch"]) * 1e6, 1),
                                   "args": {"bytes": b["bytes"], "ready_us": us(b.get("ready", b["launch"]))}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


__all__ = ["add_norm2", "enable_trace", "record_trace", "RankSync", "Stragglers", "SyncReport", "chrome_trace", "local_norm2", "local_norms", "read_report", "record_report", "take_report"]
