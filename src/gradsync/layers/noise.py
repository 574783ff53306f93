"""The gradient noise scale B_simple = tr(Sigma) / |G|^2 (McCandlish et al., 2018) from what the reducer sees.

A gradient averaged over B samples has E|G_B|^2 = |G|^2 + tr(Sigma) / B. Two batch sizes give two
unbiased estimates: the small one is each rank's window before the reduction (its squared norm rides
in the end-of-backward control, ``core/telemetry.py``), the big one the reduced window. With ranks
of different sizes B_r (uneven item counts) the estimate of tr(Sigma) sums every rank's equation:
sum_r (|G_r|^2 - |G_big|^2) / sum_r (1/B_r - 1/B_big), unbiased; |G|^2 = |G_big|^2 - tr(Sigma)/B_big.
On one rank the small batch is the window's first micro-step. ``value`` is the ratio of the running
means of the two terms over every window so far, the same on every rank.
"""
from __future__ import annotations


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
        self.trace_sum += trace
        self.norm2_sum += norm2
        self.windows += 1

    @property
    def value(self) -> float | None:
        """B_simple in the unit of the batch sizes given (items, or micro-batches); None at first."""
        return self.trace_sum / self.norm2_sum if self.windows and self.norm2_sum > 0 else None


__all__ = ["NoiseScale"]
