"""How a window's gradient is normalized: the kinds of window, item counts, and the rescale factor.

After a window's synced backward the reduction has averaged each rank's window sum over the ranks;
the accumulator then multiplies by the factor computed here from every rank's row, carried in the
phase header: ``(kind tag, item count, loss units that ran, skips)``.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from .._torch import saved_mean_reduction
from ..engine.errors import SyncError

MEAN, ITEMS = "mean loss", "num_items"
# a window's kind as carried in the phase header: 0.0 none carried, 3.0 every micro-step skipped
TAG = {MEAN: 1.0, ITEMS: 2.0, None: 3.0}
KIND_OF_TAG = {0.0: "no acc.backward()", 1.0: "a mean loss (no num_items)", 2.0: "num_items"}
Rows = dict[int, tuple[float, ...]]


def without_failed(rows: Rows, failed: list[int]) -> Rows:
    """A rank whose synced backward failed part-way was reduced as contributing nothing."""
    return {r: (row[0], 0.0, 0.0, max(row[3], 1.0)) if r in failed else row for r, row in rows.items()}


def check_closed_together(rows: Rows, window: int) -> None:
    """Raise on every rank unless every rank closed window ``window`` at this synced backward, or none did (with
    ``sync_each_batch`` a rank whose data ended mid-window syncs where another's window goes on)."""
    closing = sorted(r for r, row in rows.items() if row[0])
    if closing and len(closing) < len(rows):
        going_on = sorted(set(rows) - set(closing))
        raise SyncError(
            f"gradsync: the ranks are out of step: rank(s) {closing} closed window {window} at this synced backward "
            f"and rank(s) {going_on} did not, so they ran different numbers of micro-batches (a rank's data ended "
            "mid-window, or the ranks planned windows of different lengths). Give every rank the same number of "
            "micro-batches (DistributedSampler(drop_last=True), gradsync.ElasticSampler), or run uneven data inside "
            "model.join() with sync_each_batch=False.")


def check_kinds(rows: Rows, window: int) -> None:
    """Raise on every rank unless every rank normalized its window the same way."""
    if len({row[0] for row in rows.values()} - {TAG[None]}) <= 1:
        return
    detail = ", ".join(f"rank {r}: {KIND_OF_TAG.get(row[0], row[0])}" for r, row in sorted(rows.items()))
    raise SyncError(
        f"gradsync: the ranks closed window {window} with different kinds of acc.backward() "
        f"({detail}): a mean loss and a summed loss with num_items cannot be averaged together, so this "
        "window's gradients are wrong on every rank. Call acc.backward(loss_sum, num_items=n) on every "
        "rank, or acc.backward(mean_loss) on every rank; zero the gradients before stepping.")


def window_factor(rows: Rows, world_size: int, expected_units: float, skipped: bool) -> float | None:
    """The factor that makes the reduced window the mean over what ran; None: nothing ran anywhere.

    With ``num_items``: ``world_size / items``. With mean losses, each scaled by its share of the
    planned window (``expected_units``: micro-steps; 1 for a ``split()`` window, whose rows differ across
    ranks, each rank carrying the share of its rows that ran): ``world_size * expected_units / units that
    ran`` -- exactly 1 when every micro-step ran.
    """
    if TAG[ITEMS] in {row[0] for row in rows.values()}:
        total = sum(row[1] for row in rows.values())
        if not total > 0 and not skipped:
            raise ValueError(f"gradsync: num_items summed to {total:g} over the window and all ranks; "
                             "there is nothing to average over (pass the number of items each loss sums)")
        return world_size / total if total > 0 else None
    units = sum(row[2] for row in rows.values())
    return world_size * expected_units / units if units > 0 else None


def as_count(num_items: Any, device: torch.device) -> torch.Tensor:
    if isinstance(num_items, torch.Tensor):
        if num_items.numel() != 1:
            raise ValueError(f"gradsync: num_items must be a single number, got a tensor of shape "
                             f"{tuple(num_items.shape)}")
        return num_items.detach().reshape(()).to(device=device, dtype=torch.float64, copy=True)
    if isinstance(num_items, bool) or not isinstance(num_items, (int, float)) \
            or not math.isfinite(num_items) or num_items < 0:
        raise ValueError(f"gradsync: num_items must be a finite number >= 0 (the items the loss sums "
                         f"over), got {num_items!r}")
    return torch.tensor(float(num_items), dtype=torch.float64, device=device)


def is_mean(loss: Any) -> bool:
    """True when ``loss`` comes straight from a mean over more than one element."""
    return saved_mean_reduction(getattr(loss, "grad_fn", None), loss.numel())


MEAN_WITH_ITEMS = ("gradsync: acc.backward(loss, num_items=n) got a loss that is a mean, but it must be the sum "
                   "over the n items, or the gradient comes out n times too small; pass the sum over the items, "
                   "e.g. reduction='sum', or call acc.backward(loss) without num_items")

__all__ = ["MEAN_WITH_ITEMS", "ITEMS", "MEAN", "TAG", "as_count", "check_kinds", "is_mean", "window_factor", "without_failed"]
