"""Closing a window: the factor that makes its gradient the mean over what ran, and the skips' records.

Each rank's row ``(kind tag, item count, loss units that ran, skips)`` rides in the phase header of the
window's synced backward (``_carry``); the factor comes from every active rank's row (``normalize.py``).
Usually the accumulator multiplies the reduced gradients by it after that backward (``_close``). With
``overlap_optimizer`` each bucket steps inside the backward, so the optimizer asks for the factor
(``_prescale``, announced as ``"window_rescale"``) before each bucket steps, once the header is in.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch.distributed as dist

from .. import process
from .._torch import foreach_mul_, join_enabled
from .normalize import ITEMS, TAG, check_closed_together, check_kinds, window_factor, without_failed
from .skips import exchange_records
from .windows import Windows


def active_join(model: Any) -> Any:
    """The model's join state inside an enabled ``model.join()``, else None (torch's ``Join`` calls the join hook
    even when disabled)."""
    join = getattr(model, "join_state", None)
    return join if join is not None and join_enabled(model) else None


class WindowClose(Windows):
    """Windows that close: the rescale and the skips' records at each window's end (``GradientAccumulator``
    adds the micro-steps, their backward and their skips)."""

    def _carry(self, units: float, count: float = 0.0) -> Any:
        """At a window's synced backward, send this rank's kind of window, item count, loss units that
        ran and number of skips in its phase header; return the reader of every active rank's, or None
        where nothing is carried. Offer overlap_optimizer the window's rescale, known once the header is in."""
        if self._weights is not None:  # a split() window: the share of this rank's rows that ran (ranks' rows differ)
            units = units / sum(self._rows)
        if not self._boundary:
            if self.sync_each_batch:  # a synced micro-step inside the window: overlap_optimizer steps only at its end
                process.announce("window_rescale", self.model, lambda: None)
                if self._world_size > 1 and self._target is not None:  # to see a rank that closes its window here
                    return self._target.carry_with_next_sync(())
            return None
        self._sent, self._rescale = (float(count), float(units)), None
        carried = self._target.carry_with_next_sync((TAG[self._kind], count, float(units), float(len(self._records)))) \
            if self._world_size > 1 and self._target is not None else None
        process.announce("window_rescale", self.model, lambda: self._prescale(carried))
        return carried

    def _prescale(self, carried: Any) -> float | None:
        """overlap_optimizer's question, inside the synced backward before a bucket steps: the window's rescale."""
        self._prescaled = True
        return self._window_factor(carried)

    def _window_factor(self, carried: Any, work: Any = None) -> float | None:
        """The factor that makes the window's gradient the mean over what ran on every rank (items, or loss
        units: micro-steps or rows); None: nothing ran. Computed once per window."""
        if self._rescale is not None:  # (factor, the rows it came from)
            return self._rescale[0]
        rows = carried() if carried is not None else None
        if carried is not None and rows is None:
            raise RuntimeError("gradsync: the window's last backward synchronized no gradient (no "
                               "parameter got one through the wrapper), so the item counts were not exchanged; every "
                               "window must end with a backward through the wrapped model's forward (a forward that "
                               "bypasses it, such as torch.func.functional_call(model.module, ...), synchronizes nothing)")
        if rows is None:  # one rank, or no header (torch's DDP): every rank ran its planned share of the window
            total = self._sent[0] if self._kind == ITEMS else None
            if work is not None:
                self._wait(work[0])
                total = float(work[1])
            rows = {0: (TAG[self._kind], total or 0.0, self._units_everywhere(), float(len(self._records)))}
        join = active_join(self.model)  # divide_by_initial_world_size=False: the buckets were divided by the active ranks
        divisor = len(rows) if join is not None and join.divides_by_active else self._world_size
        rows = without_failed(rows, self._target.failed_ranks() if self._target is not None else [])
        check_closed_together(rows, self.windows)
        check_kinds(rows, self.windows)
        expected = self._scale_len if self._weights is None else 1.0  # _carry sent a split window's share
        self._rescale = (window_factor(rows, divisor, expected, any(row[3] for row in rows.values())), rows)
        return self._rescale[0]

    def _units_everywhere(self) -> float:
        """Without a header: the loss units that ran on all ranks, each rank taken to have run its planned micro-steps
        less as many as this rank did not run. ``_scale_len`` keeps the plan (``plan_window``): the window's
        micro-steps on all ranks / W; without one, this rank's own count (every rank ran what this one did)."""
        sent = self._sent[1]
        if self._weights is not None:  # a split() window: _carry sent this rank's share of its rows
            return self._world_size * sent
        return self._world_size * (self._scale_len - (self._window_len - sent))

    def _went_on(self, carried: Any) -> None:
        """A synced micro-step inside the window (``sync_each_batch``): raise if another rank closed its window here."""
        rows = carried() if carried is not None else None
        if rows:
            check_closed_together(rows, self.windows)

    def _close(self, carried: Any, work: Any = None) -> None:
        """The window's synced backward is done: rescale (unless overlap_optimizer did, bucket by bucket), note
        the skips."""
        self._window_factor(carried, work)
        (factor, rows), prescaled, self._rescale, self._prescaled = self._rescale, self._prescaled, None, False
        self.skipped = self._gather_skips(rows)
        if factor is None:
            self.window_empty = True
            warnings.warn(f"gradsync: every micro-step of window {self.windows} was skipped on every rank "
                          f"({len(self.skipped)} skips); the optimizer and scheduler do not step for it",
                          UserWarning, stacklevel=4)
            return
        if not prescaled:
            self._scale(factor)
        if self.noise.scale is not None:
            several = self._world_size > 1 and self._target is not None
            self.noise.observe(rows, items=self._kind == ITEMS, split=self._weights is not None, several=several,
                               scale_len=self._scale_len,
                               item_count=self._items, units=self._units)

    def _gather_skips(self, rows: dict[int, tuple[float, ...]]) -> list[tuple[int, int, str]]:
        if not any(row[3] for row in rows.values()):
            return []
        if self._target is None or self._world_size == 1:
            return [(0, step, reason) for step, reason in self._records]
        def exchange() -> list[tuple[int, int, str]]:  # in the group of the moment: a member may leave inside it
            group, device = self._target.control_group()
            return exchange_records(self._records, rank=dist.get_rank(group), world_size=self._world_size,
                                    group=group, device=device, wait=self._target.wait)
        return self._target.after_commit("the skip records", exchange)

    def _scale(self, factor: float) -> None:
        if factor == 1.0:
            return
        if self._target is not None:
            self._target.scale_grads_(factor)
            return
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if grads:
            foreach_mul_(grads, factor)

    def _wait(self, work: Any) -> None:
        if self._target is not None:
            self._target.wait(work, "the all-reduce of the window's item count")
        else:
            work.wait()


def _shadow_skip_records(reducer: Any, failed: list[int]) -> None:
    """A joined rank shadowed a synced backward (``model.join()``): where the active ranks' header showed skips
    (or a rank failed), they exchange the skip records next (``_gather_skips``); take part with none."""
    rows = without_failed(reducer.plane.payloads or {}, failed)
    if any(len(row) > 3 and row[3] for row in rows.values()):
        exchange_records([], rank=reducer.rank, world_size=reducer.world_size, group=reducer.plane.group,
                         device=reducer.plane.device, wait=reducer.wait)


process.listen("shadowed_sync", _shadow_skip_records)
