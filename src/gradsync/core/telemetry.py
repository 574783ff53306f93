"""What only the reducer sees: each rank's own backward time, its wait for the reduction, the slow rank.

Under DDP every rank waits for the slowest in the all-reduce, so timings taken from outside look
alike. The reducer knows when this rank's last gradient of a synced backward was ready (its own
work: from the forward's end, less the time its hooks waited on the phase header) and how long it
waited on the others (that header wait, then until every bucket was reduced). Each rank writes both, and its local gradient's squared norm when
asked (``GradientAccumulator(noise_scale=True)``), into its own slots of the end-of-backward control
(``control.py``): no extra collective, the same report on every rank.
"""
from __future__ import annotations

import logging
import statistics
from collections import deque
from dataclasses import dataclass

import torch

log = logging.getLogger("gradsync")


@dataclass(frozen=True)
class RankSync:
    """One rank's part of one synced backward."""

    compute_ms: float  # from its forward's end until its last gradient was ready, less its waits
    wait_ms: float  # waiting on the other ranks: its hooks' wait on the header, then until every bucket was reduced
    local_norm2: float | None = None  # |its window's local gradient|^2, when measured (noise scale)


@dataclass(frozen=True)
class SyncReport:
    """A synced backward as every rank saw it; the same on every rank."""

    sync: int
    ranks: dict[int, RankSync]
    slowest: int  # the rank whose gradients were ready last


def read_report(values: torch.Tensor, norms: torch.Tensor, active: list[int], sync: int,
                measured: bool) -> SyncReport:
    """Build the report from the reduced control's telemetry slots (``control.telemetry``)."""
    us, n2 = values.tolist(), norms.tolist()
    w = len(n2)
    ranks = {r: RankSync(us[r] / 1000.0, us[w + r] / 1000.0, n2[r] if measured else None) for r in active}
    return SyncReport(sync, ranks, max(active, key=lambda r: ranks[r].compute_ms))


class Stragglers:
    """Warn (once per episode) when one rank is the slowest in every one of the last ``WINDOW`` synced
    backwards and its own backward is clearly slower than the other ranks' (``RATIO`` and ``MIN_MS``:
    noise on a loaded machine does not reach both)."""

    WINDOW, RATIO, MIN_MS = 3, 1.5, 50.0

    def __init__(self) -> None:
        self.history: deque[SyncReport] = deque(maxlen=self.WINDOW)
        self.warned: int | None = None  # the rank of the episode in progress

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


__all__ = ["RankSync", "Stragglers", "SyncReport", "read_report"]
