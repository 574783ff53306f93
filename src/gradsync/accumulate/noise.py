"""The gradient noise scale B_simple = tr(Sigma) / |G|^2 (McCandlish et al., 2018) from what the reducer sees.

A gradient averaged over B samples has E|G_B|^2 = |G|^2 + tr(Sigma) / B. Two batch sizes give two
unbiased estimates: the small one is each rank's window before the reduction (its squared norm rides
in the end-of-backward control, ``engine/telemetry.py``), the big one the reduced window. With ranks
of different sizes B_r (uneven item counts) the estimate of tr(Sigma) sums every rank's equation:
sum_r (|G_r|^2 - |G_big|^2) / sum_r (1/B_r - 1/B_big), unbiased; |G|^2 = |G_big|^2 - tr(Sigma)/B_big.
On one rank the small batch is the window's first micro-step. ``value`` is the ratio of the running
means of the two terms over every window so far, the same on every rank.
"""
from __future__ import annotations

import math
from typing import Any

import torch



class NoiseScale:
    def __init__(self) -> None:
        self.trace_sum = self.norm2_sum = 0.0
        self.windows = 0

    @staticmethod
    def estimate(small: list[tuple[float, float]], big_norm2: float, big_batch: float) -> tuple[float, float] | None:
        """``small``: (|G_small|^2, B_small) pairs; return this window's unbiased (tr(Sigma), |G|^2), or None."""
        pairs = [(g2, b) for g2, b in small if 0 < b < big_batch]
        if not pairs:
            return None
        trace = sum(g2 - big_norm2 for g2, _ in pairs) / sum(1 / b - 1 / big_batch for _, b in pairs)
        return trace, big_norm2 - trace / big_batch

    def add(self, trace: float, norm2: float) -> None:
        if not math.isfinite(trace) or not math.isfinite(norm2):  # a window a GradScaler skips (inf gradients)
            return
        self.trace_sum += trace
        self.norm2_sum += norm2
        self.windows += 1

    @property
    def value(self) -> float | None:
        """B_simple in the unit of the batch sizes given (items, or micro-batches); None at first."""
        return self.trace_sum / self.norm2_sum if self.windows and self.norm2_sum > 0 else None


class NoiseEstimates:
    """The accumulator's gradient noise scale (``scale``, None when off) and the closed window's gradient norm."""

    def __init__(self, model: Any, enabled: bool):
        self.model = model
        self.scale = NoiseScale() if enabled else None
        self.first: tuple[float, float] | None = None  # one rank: the window's first micro-step (|G|^2, batch)
        self.grad_norm: float | None = None  # the closed window's, at the latest read
        self.local_norms: Any = None  # several ranks: a reader of each rank's local |G_r|^2 (measure_local_norms)

    def start_window(self) -> None:
        self.grad_norm, self.first = None, None

    def norm2(self) -> float:
        if getattr(self.model, "sharded", False):  # .grad is None there: a norm of nothing would read 0.0
            raise NotImplementedError(
                "gradsync: acc.grad_norm on a ShardedDataParallel model: each rank holds only its shard of the "
                "gradient. model.clip_grad_norm_(float('inf')) returns the total norm (every rank must call it)")
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not grads:
            return 0.0
        norms = [torch.linalg.vector_norm(g if g.is_complex() or g.dtype.itemsize > 4 else g.float()) for g in grads]
        return float(torch.linalg.vector_norm(torch.stack([n.double() for n in norms])) ** 2)

    def note_first(self, count: Any, *, first: bool, one_rank: bool, scale_len: float) -> None:
        """One rank: the window's first micro-step is the small batch (its gradient alone is in .grad now);
        ``count``: its item count (num_items), or None for a mean loss (one micro-batch, scaled 1/scale_len)."""
        if self.scale is None or not first or not one_rank:
            return
        batch = 1.0 if count is None else float(count)
        if batch > 0:
            scale = scale_len if count is None else 1.0 / batch
            self.first = (self.norm2() * scale ** 2, batch)

    def observe(self, rows: dict[int, tuple[float, ...]], *, items: bool, split: bool, several: bool,
                scale_len: float, item_count: Any, units: int) -> None:
        """The window closed (its reduced gradient is in .grad). ``several`` ranks: ``local_norms`` (the synced
        backward's) has every rank's local squared norm; one rank: ``first`` is the small batch."""
        big2 = self.norm2()  # not kept as grad_norm: a GradScaler unscales after this (grad_norm reads it then)
        if split:
            return  # a split() window weights rows, not micro-batches: no estimate
        if several:
            small, norms = [], self.local_norms() if self.local_norms is not None else None
            for r, row in rows.items():
                mine = norms.get(r) if norms is not None else None
                batch = row[1] if items else row[2]
                if mine is not None and batch > 0:
                    small.append((mine * ((1 / batch) if items else (scale_len / batch)) ** 2, batch))
            big = sum(b for _, b in small)
        else:
            small = [self.first] if self.first is not None else []
            big = float(item_count) if items else float(units)
        estimate = self.scale.estimate(small, big2, big)
        if estimate is not None:
            self.scale.add(*estimate)


__all__ = ["NoiseEstimates", "NoiseScale"]
