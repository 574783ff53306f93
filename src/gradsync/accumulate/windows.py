"""Where an accumulator is in its windows of micro-steps, the data that feeds them, and checkpoints.

``Windows`` knows nothing of models: which micro-step of which window this is, whether it closes the
window (``is_boundary``) or communicates (``sync_gradients``), what ran in the window so far, and the
data helpers ``iterate`` and ``split``. ``GradientAccumulator`` (``accumulator.py``) is a ``Windows``
that drives a model: backward, normalization and skips; it overrides ``at_window_start`` and the
world size.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import chain
from typing import Any

import torch

from ..tree import flatten, narrow, row_bounds, unflatten


class Windows:
    """Windows of ``steps`` micro-steps (a ``split()`` window, or the data's end, may change one's length)."""

    @property
    def _world_size(self) -> int:
        return 1  # ranks that share each window's micro-steps (an accumulator asks its model's group)

    def at_window_start(self) -> None:
        """Between windows, before the first micro-step of the next (an accumulator announces it)."""

    def __init__(self, steps: int, sync_each_batch: bool, device: torch.device):
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"gradsync: steps must be an integer >= 1 (micro-steps per optimizer step), "
                             f"got {steps!r}")
        self.steps = steps
        self.sync_each_batch = bool(sync_each_batch)
        self._device = device  # where item counts live
        self._active = False
        self._backward_done = False
        self._position = 0  # micro-steps taken in the current window, the current one included
        self._window_len = steps  # planned length: loss scale 1/len, a shorter close is corrected
        self._scale_len = steps  # the loss's denominator: the window's micro-steps on all ranks together / W
        self._plan: tuple[int, int, int] | None = None  # plan_window()'s (here, on all ranks, most on one rank)
        self._short_by = 0  # micro-steps this rank runs fewer than the busiest rank in this window
        self._boundary = True  # before the first micro-step: "between windows"
        self._end_of_data = False  # iterate() is yielding the data's last item
        self._ahead: list[Any] = []  # iterate()'s item read ahead from a stateful loader, for state_dict()
        self._resumed: list[Any] = []  # such an item from load_state_dict(): the next iterate() yields it first
        self._kind: str | None = None  # MEAN or ITEMS (normalize.py): what the window's backwards took
        self._items: torch.Tensor | None = None  # this rank's item count in the current window
        self._weights: list[float] | None = None  # per-micro-step loss weights of a split() window
        self._next_weights: list[float] | None = None
        self._rows: list[int] | None = None  # rows of each micro-batch of a split() window
        self._next_rows: list[int] | None = None
        self.windows = 0  # windows started so far
        self._ran: list[int] = []  # positions of the micro-steps that ran in this window
        self._units = 0  # their loss units: micro-steps, or rows of a split() window
        self._records: list[tuple[int, str]] = []  # this window's (micro-step, reason) skips here
        self.skipped: list[tuple[int, int, str]] = []  # (rank, micro_step, reason) of the last closed window
        self.window_empty = False  # every micro-step of the closed window was skipped: no step

    # ---------------------------------------------------------------- state
    @property
    def is_boundary(self) -> bool:
        """True when this micro-step closes a window: the optimizer and scheduler step."""
        return self._boundary

    @property
    def sync_gradients(self) -> bool:
        """True when this micro-step communicates gradients."""
        return self._boundary or self.sync_each_batch

    def _start_window(self) -> None:
        self.windows += 1
        self._position = 0
        self._kind, self._items = None, None
        self._weights, self._next_weights = self._next_weights, None
        self._rows, self._next_rows = self._next_rows, None
        self._window_len = len(self._weights) if self._weights is not None else self.steps
        self._scale_len, self._short_by = self._window_len, 0
        if self._plan is not None and self._weights is None:
            self._window_len, total, most = self._plan
            self._scale_len = total / self._world_size  # the reduction averages over the ranks
            self._short_by = most - self._window_len
        self._plan = None
        self._ran, self._units, self._records, self.window_empty = [], 0, [], False

    @property
    def micro_step(self) -> int:
        """The current micro-step's 0-based place in its window (inside ``accumulate()``)."""
        return self._position - 1

    def plan_window(self, here: int, total: int, most: int | None = None) -> None:
        """The next window runs ``here`` micro-steps on this rank, ``total`` on all ranks together and
        ``most`` (default ``here``) on the busiest rank (uneven counts: ``ElasticSampler``); a mean loss
        is then averaged over all ``total``."""
        most = here if most is None else most
        if not 1 <= here <= most <= total:
            raise ValueError(f"gradsync: plan_window needs 1 <= here <= most <= total, got here={here}, "
                             f"most={most}, total={total}")
        self._plan = (int(here), int(total), int(most))

    # ---------------------------------------------------------------- data
    def iterate(self, iterable: Iterable, micro_batches: int | None = None) -> Iterator[Any]:
        """Yield micro-batches, closing a short last window where the data ends.

        With ``micro_batches=n`` each item is a large batch that runs as one window of ``n``
        micro-batches (see ``split``).
        """
        if micro_batches is not None:
            for batch in iterable:
                yield from self.split(batch, micro_batches)
            self.data_ended()
            return
        self.at_window_start()  # a replica that joins gets the members' state before its first item
        # a loader with a state_dict() (torchdata's StatefulDataLoader) is one item past what trained while a step
        # runs: state_dict() keeps that item, and the next iterate() after load_state_dict() yields it first
        it, stateful = chain(self._resumed, iterable), callable(getattr(iterable, "state_dict", None))
        self._resumed, self._ahead = [], []  # one a loop left by break belongs to that loop's loader, not this one
        try:
            current = next(it)
        except StopIteration:
            return
        for following in it:  # look one ahead: only then is the last item known
            self._ahead = [following] if stateful else []
            yield current
            current = following
        self._ahead, self._end_of_data = [], True
        yield current
        self._end_of_data = False  # left out without accumulate(): not the end of the next data's first window
        self.data_ended()

    def data_ended(self) -> None:
        """Where the data runs out, after the last item's micro-step (``GradientAccumulator`` checks its window)."""

    def split(self, batch: Any, n: int | None = None) -> list[Any]:
        """Split ``batch`` along dim 0 into ``n`` (default ``steps``) micro-batches forming one window.

        Mean losses are weighted by each micro-batch's share of the rows, so the window's gradient
        equals the whole batch's even when ``n`` does not divide it.
        """
        n = self.steps if n is None else n
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"gradsync: split() needs a number of micro-batches >= 1, got {n!r}")
        if not self._boundary or self._active:
            raise RuntimeError(f"gradsync: split() starts a window, but the current window has run "
                               f"{self._position} of {self._window_len} micro-steps; call it between windows")
        leaves, spec = flatten(batch)
        rows = _rows(leaves)
        if rows < n:
            raise ValueError(f"gradsync: cannot split a batch of {rows} rows into {n} micro-batches")
        bounds = row_bounds(rows, n)
        self._next_weights = [length / rows for _, length in bounds]
        self._next_rows = [length for _, length in bounds]
        return [unflatten([narrow(v, start, length) for v in leaves], spec) for start, length in bounds]

    def may_zero(self) -> bool:
        """True where zeroing gradients now cannot drop the window in progress (``wrap_optimizer``)."""
        # Inside a micro-step, before its backward, the gradients belong to this window unless it
        # is the window's first micro-step, even on the boundary micro-step: zeroing there would
        # drop the window. After the backward (or between micro-steps) only a closed window zeroes.
        if self._active and not self._backward_done:
            return self._position == 1
        return self._boundary

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Return the position in the window and the pending normalization state."""
        return {"steps": self.steps, "sync_each_batch": self.sync_each_batch, "position": self._position,
                "window_len": self._window_len, "boundary": self._boundary, "kind": self._kind,
                "items": None if self._items is None else float(self._items),
                "weights": self._weights, "next_weights": self._next_weights, "windows": self.windows,
                "rows": self._rows, "next_rows": self._next_rows, "ran": list(self._ran), "units": self._units,
                "skips": list(self._records), "scale_len": self._scale_len, "plan": self._plan,
                "short_by": self._short_by, "ahead": list(self._ahead)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume a window where ``state_dict()`` left it (gradients are the caller's to restore)."""
        if self._active:
            raise RuntimeError("gradsync: load_state_dict() inside accumulate(); load between micro-steps")
        for key in ("steps", "sync_each_batch"):
            if state[key] != getattr(self, key):
                raise ValueError(f"gradsync: the checkpoint has {key}={state[key]!r} but this accumulator "
                                 f"has {getattr(self, key)!r}; construct it with the same settings")
        self._position, self._window_len = state["position"], state["window_len"]
        self._boundary, self._kind = state["boundary"], state["kind"]
        self._weights, self._next_weights = state["weights"], state["next_weights"]
        self.windows = state["windows"]
        # checkpoints from before skips existed: every micro-step so far ran
        self._rows, self._next_rows = state.get("rows"), state.get("next_rows")
        if self._weights is not None and self._rows is None:
            raise ValueError("gradsync: this checkpoint was saved mid-way through a split() window by an older "
                             "gradsync; resume it at a window boundary")
        ran = state.get("ran", list(range(1, self._position + 1)) if not self._boundary else [])
        self._ran = list(ran)
        self._units = state.get("units", len(ran) if self._rows is None else sum(self._rows[k - 1] for k in ran))
        self._records = [tuple(r) for r in state.get("skips", [])]
        self._scale_len, self._plan = state.get("scale_len", self._window_len), state.get("plan")
        self._short_by = state.get("short_by", 0)
        items = state["items"]
        self._items = None if items is None else torch.tensor(items, dtype=torch.float64,
                                                              device=self._device)
        self._end_of_data, self._resumed = False, list(state.get("ahead", []))


def _rows(leaves: list[Any]) -> int:
    sizes = {t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0}
    if len(sizes) != 1:
        raise ValueError("gradsync: split() needs a batch whose tensors share one size along dim 0, got "
                         + (f"sizes {sorted(sizes)}" if sizes else "no tensor with a dim 0"))
    return sizes.pop()


__all__ = ["Windows"]
