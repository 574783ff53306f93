"""Gradient accumulation in windows of micro-steps: when to communicate, when to step, how to scale.

Two facts are kept apart on purpose: whether a micro-step *communicates* (``sync_gradients``) and
whether it *closes a window* so the optimizer and scheduler step (``is_boundary``). The model's
sync switch (``require_backward_grad_sync``) is read when backward runs, so ``accumulate()`` sets
it for the whole micro-step. The accumulator only needs that switch, ``scale_grads_(factor)``,
``process_group`` and, from a gradsync wrapper, the ``SyncTarget`` methods of ``core/seam.py``
(bounded waits, a value carried in the next phase header), so any gradsync wrapper (and torch's
own DistributedDataParallel, or a plain module on one process) works.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..core._torch import foreach_mul_, saved_mean_reduction
from ..core.control import SyncError
from ..core.seam import SyncTarget
from .skips import SkipMicroStep, check_skip_on, exchange_records, reason_of, skippable
from .tree import flatten, narrow, row_bounds, unflatten
from .window import WindowOptimizer, WindowScheduler

_MEAN, _ITEMS = "mean loss", "num_items"
# a window's kind as carried in the phase header: 0.0 none carried, 3.0 every micro-step skipped
_TAG = {_MEAN: 1.0, _ITEMS: 2.0, None: 3.0}
_KIND_OF_TAG = {0.0: "no acc.backward()", 1.0: "a mean loss (no num_items)", 2.0: "num_items"}


class GradientAccumulator:
    """Accumulate gradients over windows of ``steps`` micro-steps, communicating once per window.

    Inside a window the model runs without communication; the micro-step that closes it syncs
    (every micro-step syncs with ``sync_each_batch=True``, which trades communication for not
    holding unreduced gradients, but the optimizer still steps only at window ends).
    """

    def __init__(self, model: nn.Module, steps: int, sync_each_batch: bool = False, *,
                 skip_on: Any = (), skip_nonfinite: bool = False):
        if not isinstance(model, nn.Module):
            raise TypeError(f"gradsync: GradientAccumulator needs an nn.Module, got {type(model).__name__}")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"gradsync: steps must be an integer >= 1 (micro-steps per optimizer step), "
                             f"got {steps!r}")
        self.model = model
        self.steps = steps
        self.sync_each_batch = bool(sync_each_batch)
        self._target = model if isinstance(model, SyncTarget) else None  # a gradsync wrapper
        # torch's DDP has the same switch (read at its forward) and a process group, not the rest
        self._switchable = hasattr(model, "require_backward_grad_sync")
        if self._switchable:
            self._group = getattr(model, "process_group", None) or dist.group.WORLD
            self._world_size = dist.get_world_size(self._group)
        else:
            self._group, self._world_size = None, 1
        self._active = False
        self._backward_done = False
        self._position = 0  # micro-steps taken in the current window, the current one included
        self._window_len = steps  # planned length: loss scale 1/len, a shorter close is corrected
        self._boundary = True  # before the first micro-step: "between windows"
        self._end_of_data = False  # iterate() is yielding the data's last item
        self._kind: str | None = None  # _MEAN or _ITEMS: what the current window's backwards took
        self._items: torch.Tensor | None = None  # this rank's item count in the current window
        self._weights: list[float] | None = None  # per-micro-step loss weights of a split() window
        self._next_weights: list[float] | None = None
        self._rows: list[int] | None = None  # rows of each micro-batch of a split() window
        self._next_rows: list[int] | None = None
        self.windows = 0  # windows started so far
        self._warned_mean = False
        # skips (skips.py): a micro-step that ends early on one rank costs that micro-step only
        self.skip_on, self.skip_nonfinite = check_skip_on(skip_on), bool(skip_nonfinite)
        if (self.skip_on or self.skip_nonfinite) and self._world_size > 1 and self._target is None:
            raise ValueError("gradsync: skip_on and skip_nonfinite need a gradsync model on several ranks (it "
                             f"replays a skipped micro-step's collectives); got {type(model).__name__}")
        self._ran: list[int] = []  # positions of the micro-steps that ran in this window
        self._units = 0  # their loss units: micro-steps, or rows of a split() window
        self._records: list[tuple[int, str]] = []  # this window's (micro-step, reason) skips here
        self._started = False  # this micro-step's backward began
        self._mark: Any = None
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
        self._ran, self._units, self._records, self.window_empty = [], 0, [], False

    @contextlib.contextmanager
    def accumulate(self) -> Iterator[None]:
        """Run one micro-step: no communication inside a window unless ``sync_each_batch``."""
        if self._active:
            raise RuntimeError("gradsync: accumulate() is already active; each micro-step enters it once "
                               "(do not nest accumulate() blocks)")
        if self._boundary:
            self._start_window()
        self._position += 1
        self._boundary = self._position >= self._window_len or self._end_of_data
        self._end_of_data = False
        self._active, self._backward_done, self._started = True, False, False
        previous = self.model.require_backward_grad_sync if self._switchable else None
        if self._switchable:
            self.model.require_backward_grad_sync = self.sync_gradients
        self._mark = self._target.mark_micro_step() if self._target is not None else None
        try:
            yield
        except BaseException as exc:
            if not skippable(exc, self.skip_on):
                raise
            self._skipped_here(exc)
        finally:
            self._active = False
            if self._switchable:
                self.model.require_backward_grad_sync = previous

    def backward(self, loss: torch.Tensor, num_items: int | float | torch.Tensor | None = None) -> None:
        """With ``num_items=n``, ``loss`` must be the SUM over ``n`` local items; without it, a mean.

        Back-propagates ``loss`` scaled so that a window's gradient equals one big batch's. With
        ``num_items`` the window's gradient is the mean over every item of every micro-step on every
        rank; a mean loss there would make it ``n`` times too small (warned once where the loss
        visibly comes from a mean reduction).
        """
        if not self._active:
            raise RuntimeError("gradsync: acc.backward() must run inside `with acc.accumulate():` (the "
                               "accumulator needs to know which micro-step of the window this is)")
        if self._started:
            raise RuntimeError("gradsync: acc.backward() was already called in this micro-step; add the "
                               "losses and call backward once per accumulate() block")
        if self.skip_nonfinite and not bool(torch.isfinite(loss.detach()).all()):
            raise SkipMicroStep(f"non-finite loss ({float(loss.detach().float().sum()):g})")
        kind = _MEAN if num_items is None else _ITEMS
        count = None if num_items is None else _as_count(num_items, self._count_device())
        if self._kind is None:
            self._kind = kind
        elif kind != self._kind:
            raise RuntimeError(f"gradsync: this window mixes backward with {self._kind} and with "
                               f"{kind}; use one kind for every micro-step of a window (pass num_items "
                               "on every call, or on none)")
        if kind == _ITEMS:
            if not self._warned_mean and _is_mean(loss):
                self._warned_mean = True
                warnings.warn("gradsync: acc.backward(loss, num_items=n) got a loss that is a mean, but it "
                              "must be the sum over the n items, or the gradient comes out n times too "
                              "small; pass the sum over the items, e.g. reduction='sum', or call "
                              "acc.backward(loss) without num_items", UserWarning, stacklevel=2)
            self._backward_items(loss, count)
            return
        unit = self._unit()
        carried = self._carry(self._units + unit)
        self._started = True
        if self._weights is not None:
            (loss * self._weights[self._position - 1]).backward()
        else:
            (loss / self._window_len).backward()
        self._ran_here(unit)
        if self._boundary:
            self._close(carried)

    def _backward_items(self, loss: torch.Tensor, count: torch.Tensor) -> None:
        items = count if self._items is None else self._items + count
        work = None
        # gradsync's DDP carries the count in the synced backward's phase header: no collective
        # of its own that could pair with a different one on a rank that disagrees about the window
        unit = self._unit()
        carried = self._carry(self._units + unit, float(items))
        if self._boundary and self._world_size > 1 and carried is None:
            # Launched before backward on every rank, so it overlaps the backward and pairs up
            # with the same collective on the other ranks ahead of the gradient buckets.
            total = items.clone()
            work = (dist.all_reduce(total, group=self._group, async_op=True), total)
        self._started = True
        loss.backward()
        self._items = items
        self._ran_here(unit)
        if self._boundary:
            self._close(carried, work)

    def _unit(self) -> int:
        """This micro-step's share of the window's loss: one micro-step, or its rows in a split() window."""
        return 1 if self._weights is None else self._rows[self._position - 1]

    def _ran_here(self, unit: int) -> None:
        self._backward_done = True
        self._ran.append(self._position)
        self._units += unit

    def _carry(self, units: int, count: float = 0.0) -> Any:
        """At a window's synced backward, send this rank's kind of window, item count, loss units that
        ran and number of skips in its phase header; return the reader of every active rank's, or None
        where nothing is carried."""
        if not (self._boundary and self._world_size > 1 and self._target is not None):
            return None
        return self._target.carry_with_next_sync((_TAG[self._kind], count, float(units), float(len(self._records))))

    def _close(self, carried: Any, work: Any = None) -> None:
        """The window's synced backward is done: rescale so that the window's gradient is the mean
        over what ran on every rank (items, or loss units: micro-steps or rows), note the skips."""
        rows = carried() if carried is not None else None
        if carried is not None and rows is None:
            raise RuntimeError("gradsync: the window's last backward synchronized no gradient (no "
                               "parameter got one), so the item counts were not exchanged; every "
                               "window must end with a backward through the model")
        if rows is None:  # one rank, or no header: every rank is taken to have run what this one did
            w = self._world_size
            total = float(self._items) if work is None and self._items is not None else None
            if work is not None:
                self._wait(work[0])
                total = float(work[1])
            rows = {0: (_TAG[self._kind], total or 0.0, float(w * self._units), float(len(self._records)))}
        self._check_kinds(rows)
        self.skipped = self._gather_skips(rows)
        tags = {row[0] for row in rows.values()}
        if _TAG[_ITEMS] in tags:
            total = sum(row[1] for row in rows.values())
            if not total > 0 and not self.skipped:
                raise ValueError(f"gradsync: num_items summed to {total:g} over the window and all ranks; "
                                 "there is nothing to average over (pass the number of items each loss sums)")
            # the reduction already averaged over ranks: undo that, then divide by the global count
            factor = self._world_size / total if total > 0 else None
        else:
            units = sum(row[2] for row in rows.values())
            expected = self._window_len if self._weights is None else sum(self._rows)
            factor = self._world_size * expected / units if units > 0 else None
        if factor is None:
            self.window_empty = True
            warnings.warn(f"gradsync: every micro-step of window {self.windows} was skipped on every rank "
                          f"({len(self.skipped)} skips); the optimizer and scheduler do not step for it",
                          UserWarning, stacklevel=4)
            return
        self._scale(factor)

    def _gather_skips(self, rows: dict[int, tuple[float, ...]]) -> list[tuple[int, int, str]]:
        if not any(row[3] for row in rows.values()):
            return []
        if self._target is None or self._world_size == 1:
            return [(0, step, reason) for step, reason in self._records]
        return exchange_records(self._records, rank=dist.get_rank(self._group), world_size=self._world_size,
                                group=self._group, device=self._count_device(), wait=self._target.wait)

    # ---------------------------------------------------------------- skips
    def skip(self, reason: str = "skipped") -> None:
        """End this micro-step on this rank: it contributes nothing, and the window's gradient is the
        exact mean over what ran on every rank. Call it inside ``accumulate()``, before ``backward``."""
        if not self._active:
            raise RuntimeError("gradsync: acc.skip() must run inside `with acc.accumulate():`")
        if self._backward_done:
            raise RuntimeError("gradsync: acc.skip() after acc.backward(): this micro-step's gradient is "
                               "already in the window; skip before the backward")
        raise SkipMicroStep(str(reason))

    def _skipped_here(self, exc: BaseException) -> None:
        """This micro-step ended early (``exc``): record it and run what the other ranks run in it."""
        if self._backward_done:  # the backward completed: its gradient is in, so this is no skip
            raise exc
        step = self._position - 1
        self._records.append((step, reason_of(exc)))
        # before the stand-in's synced backward, whose header carries it
        carried = self._carry(self._units, float(self._items) if self._items is not None else 0.0)
        status = self._target.stand_in(self._mark, self.sync_gradients) if self._target is not None \
            else ("dropped" if self._started else "replayed")
        if status == "failed":
            raise RuntimeError(
                f"gradsync: micro-step {step} of window {self.windows} failed during its synced backward "
                f"({reason_of(exc)}); buckets holding part of its gradient were already sent, so it cannot "
                "be skipped exactly. Only failures before or outside the synced backward are skipped.") from exc
        if status == "dropped":  # a backward failed part-way: its partial gradients went with the window
            if self._target is None:
                for p in self.model.parameters():
                    p.grad = None
            self._records += [(k - 1, f"dropped with micro-step {step}: its backward failed part-way")
                              for k in self._ran]
            self._ran, self._units, self._items = [], 0, None
        if self._boundary:
            self._close(carried)

    def _check_kinds(self, rows: dict[int, tuple[float, ...]] | None) -> None:
        """Raise on every rank unless every rank normalized its window the same way."""
        if rows is None or len({row[0] for row in rows.values()} - {_TAG[None]}) <= 1:
            return
        detail = ", ".join(f"rank {r}: {_KIND_OF_TAG.get(row[0], row[0])}" for r, row in sorted(rows.items()))
        raise SyncError(
            f"gradsync: the ranks closed window {self.windows} with different kinds of acc.backward() "
            f"({detail}): a mean loss and a summed loss with num_items cannot be averaged together, so this "
            "window's gradients are wrong on every rank. Call acc.backward(loss_sum, num_items=n) on every "
            "rank, or acc.backward(mean_loss) on every rank; zero the gradients before stepping.")

    def _count_device(self) -> torch.device:
        for p in self.model.parameters():
            return p.device
        return torch.device("cpu")

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

    # ---------------------------------------------------------------- data
    def iterate(self, iterable: Iterable, micro_batches: int | None = None) -> Iterator[Any]:
        """Yield micro-batches, closing a short last window where the data ends.

        With ``micro_batches=n`` each item is a large batch that runs as one window of ``n``
        micro-batches (see ``split``).
        """
        if micro_batches is not None:
            for batch in iterable:
                yield from self.split(batch, micro_batches)
            return
        it = iter(iterable)
        try:
            current = next(it)
        except StopIteration:
            return
        for following in it:  # look one ahead: only then is the last item known
            yield current
            current = following
        self._end_of_data = True
        yield current

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

    # ---------------------------------------------------------------- wrappers
    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Return ``optimizer`` whose ``step()``/``zero_grad()`` act only where a window ends.

        ``zero_grad()`` never clears the window in progress, so it may also sit at the top of the loop.
        """
        return WindowOptimizer(optimizer, self)

    def wrap_scheduler(self, scheduler: Any) -> Any:
        """Return ``scheduler`` whose ``step()`` acts once per window, at its end."""
        return WindowScheduler(scheduler, self)

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
                "skips": list(self._records)}

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
        items = state["items"]
        self._items = None if items is None else torch.tensor(items, dtype=torch.float64,
                                                              device=self._count_device())
        self._end_of_data = False


def _as_count(num_items: Any, device: torch.device) -> torch.Tensor:
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


def _is_mean(loss: Any) -> bool:
    """True when ``loss`` comes straight from a mean over more than one element."""
    return saved_mean_reduction(getattr(loss, "grad_fn", None), loss.numel())


def _rows(leaves: list[Any]) -> int:
    sizes = {t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0}
    if len(sizes) != 1:
        raise ValueError("gradsync: split() needs a batch whose tensors share one size along dim 0, got "
                         + (f"sizes {sorted(sizes)}" if sizes else "no tensor with a dim 0"))
    return sizes.pop()
