"""Gradient accumulation in windows of micro-steps: when to communicate, when to step, how to scale.

Two facts are kept apart on purpose: whether a micro-step *communicates* (``sync_gradients``) and
whether it *closes a window* so the optimizer and scheduler step (``is_boundary``). The model's
sync switch (``require_backward_grad_sync``) is read when backward runs, so ``accumulate()`` sets
it for the whole micro-step. The accumulator only needs that switch, ``scale_grads_(factor)``,
``process_group`` and, from a gradsync wrapper, the ``SyncTarget`` methods of ``ddp/seam.py``
(bounded waits, a value carried in the next phase header), so any gradsync wrapper (and torch's
own DistributedDataParallel, or a plain module on one process) works.
"""
from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._torch import stamp, unchanged
from ..engine.errors import SyncError
from ..ddp.seam import SyncTarget
from .. import process
from .noise import NoiseEstimates
from .normalize import ITEMS, MEAN, MEAN_WITH_ITEMS, as_count, is_mean
from .skips import SkipMicroStep, check_skip_on, reason_of, skippable
from .optim import WindowOptimizer, WindowScheduler
from .close import WindowClose, active_join

SYNC_EACH_BATCH_IN_JOIN = (
    "gradsync: sync_each_batch=True inside model.join() is not supported: each synced micro-step reduces the window's "
    "gradient so far again, and a rank that joined adds zeros where the others add that sum, so the window's earlier "
    "micro-batches would count less. Use sync_each_batch=False (the window is reduced once), or deal every rank the same "
    "number of micro-batches (e.g. DistributedSampler(drop_last=True), gradsync.ElasticSampler) and leave out join().")


class GradientAccumulator(WindowClose):
    """Accumulate gradients over windows of ``steps`` micro-steps, communicating once per window.

    Inside a window the model runs without communication; the micro-step that closes it syncs
    (every micro-step syncs with ``sync_each_batch=True``, which trades communication for not
    holding unreduced gradients, but the optimizer still steps only at window ends).
    """

    def __init__(self, model: nn.Module, steps: int, sync_each_batch: bool = False, *,
                 skip_on: Any = (), skip_nonfinite: bool = False, noise_scale: bool = False):
        if not isinstance(model, nn.Module):
            raise TypeError(f"gradsync: GradientAccumulator needs an nn.Module, got {type(model).__name__}")
        super().__init__(steps, sync_each_batch, _device_of(model))
        self.model, self._target = model, model if isinstance(model, SyncTarget) else None  # _target: a gradsync wrapper
        if self._target is not None:  # item counts ride its phase headers: on the CPU, never read back from a GPU
            self._device = self._target.control_group()[1]
        # torch's DDP has the same switch (read at its forward) and a process group, not the rest
        self._switchable = hasattr(model, "require_backward_grad_sync")
        self._warned_mean = False
        # skips (skips.py): a micro-step that ends early on one rank costs that micro-step only
        self.skip_on, self.skip_nonfinite = check_skip_on(skip_on), bool(skip_nonfinite)
        if (self.skip_on or self.skip_nonfinite) and self._world_size > 1 and self._target is None:
            raise ValueError("gradsync: skip_on and skip_nonfinite need a gradsync model on several ranks (it "
                             f"replays a skipped micro-step's collectives); got {type(model).__name__}")
        if self.skip_on and self._target is not None:  # a backward that fails part-way is reduced again
            self._target.keep_window_apart()
        self.wrapped_optimizers, self.wrapped_schedulers = [], []  # sent to a replica that joins (elastic/join.py)
        self._boundary_done = -1  # the window boundary at_window_start() last ran at
        self._owed: Any = None  # (what, [(param, stamp of its .grad)]): a window this rank's skip closed, not yet acted on
        self.noise = NoiseEstimates(model, noise_scale)  # the gradient noise scale and the window's norm (noise.py)
        if noise_scale and self._target is not None:
            if getattr(model, "sharded", False) or sync_each_batch:
                raise ValueError("gradsync: noise_scale=True needs every rank's whole window gradient, which "
                                 "ShardedDataParallel does not keep, and which sync_each_batch=True reduces micro-step "
                                 "by micro-step; use DistributedDataParallel and sync_each_batch=False")
            self.noise.local_norms = self._target.measure_local_norms()
        self._started = False  # this micro-step's backward began
        self._pending_carry: Any = None  # the reader of what this micro-step's backward carries
        self._mark: Any = None
        # the window's rescale: (items, units) sent, (factor, rows) once known, whether overlap_optimizer applied it
        self._sent, self._rescale, self._prescaled = (0.0, 0.0), None, False
        process.announce("accumulator", self)  # features that follow windows attach here (gradsync.elastic)

    def window_position(self) -> tuple[int, int, int] | None:
        """(windows started, micro-steps planned for the current one, those of it already synced: sync_each_batch)."""
        return (self.windows, self._window_len, self._position - 1 if self.sync_each_batch else 0) if self.windows else None

    @property  # read at each use: a commit protocol may re-form the model's group
    def _group(self) -> Any:
        return (getattr(self.model, "process_group", None) or dist.group.WORLD) if self._switchable else None

    @property
    def _world_size(self) -> int:
        return dist.get_world_size(self._group) if self._switchable else 1

    @contextlib.contextmanager
    def accumulate(self) -> Iterator[None]:
        """Run one micro-step: no communication inside a window unless ``sync_each_batch``."""
        if self._active:
            raise RuntimeError("gradsync: accumulate() is already active; each micro-step enters it once "
                               "(do not nest accumulate() blocks)")
        if self._boundary:
            self.data_ended()
            self.at_window_start()
            self._start_window()
            if self.sync_each_batch and self._window_len > 1 and active_join(self.model) is not None:
                raise NotImplementedError(SYNC_EACH_BATCH_IN_JOIN)
            self.noise.start_window()
            if self._short_by and self._target is not None:
                self._target.advance_counters(self._short_by)
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
        """Back-propagate ``loss`` scaled so that a window's gradient equals one big batch's. Without
        ``num_items``, ``loss`` is a mean; with ``num_items=n`` it must be the SUM over ``n`` local items,
        and the window's gradient is the mean over every item of every micro-step on every rank."""
        if not self._active:
            raise RuntimeError("gradsync: acc.backward() must run inside `with acc.accumulate():` (the "
                               "accumulator needs to know which micro-step of the window this is)")
        if self._started:
            raise RuntimeError("gradsync: acc.backward() was already called in this micro-step; add the "
                               "losses and call backward once per accumulate() block")
        if self.skip_nonfinite and not bool(torch.isfinite(loss.detach()).all()):
            raise SkipMicroStep(f"non-finite loss ({float(loss.detach().float().sum()):g})")
        kind = MEAN if num_items is None else ITEMS
        count = None if num_items is None else as_count(num_items, self._device)
        if self._kind is None:
            self._kind = kind
        elif kind != self._kind:
            raise RuntimeError(f"gradsync: this window mixes backward with {self._kind} and with "
                               f"{kind}; use one kind for every micro-step of a window (pass num_items "
                               "on every call, or on none)")
        if kind == ITEMS:
            if not self._warned_mean and is_mean(loss):
                self._warned_mean = True
                warnings.warn(MEAN_WITH_ITEMS, UserWarning, stacklevel=2)
            self._backward_items(loss, count)
            return
        unit = self._unit()
        carried = self._pending_carry = self._carry(self._units + unit)
        self._started = True
        if self._weights is not None:
            (loss * self._weights[self._position - 1]).backward()
        else:
            (loss / self._scale_len).backward()
        self._note_first(None)
        self._ran_here(unit)
        if self._boundary:
            self._close(carried)
        else:
            self._went_on(carried)

    def _backward_items(self, loss: torch.Tensor, count: torch.Tensor) -> None:
        items = count if self._items is None else self._items + count
        work = None
        # gradsync's DDP carries the count in the synced backward's phase header: no collective
        # of its own that could pair with a different one on a rank that disagrees about the window
        unit = self._unit()
        carried = self._pending_carry = self._carry(self._units + unit, float(items))
        if self._boundary and self._world_size > 1 and carried is None:
            # Launched before backward on every rank, so it overlaps the backward and pairs up
            # with the same collective on the other ranks ahead of the gradient buckets.
            total = items.clone()
            work = (dist.all_reduce(total, group=self._group, async_op=True), total)
        self._started = True
        loss.backward()
        self._note_first(count)
        self._items = items
        self._ran_here(unit)
        if self._boundary:
            self._close(carried, work)
        else:
            self._went_on(carried)

    def _note_first(self, count: Any) -> None:
        first = self._position == 1 and self._weights is None
        self.noise.note_first(count, first=first, one_rank=self._world_size == 1, scale_len=self._scale_len)

    def _unit(self) -> int:
        """This micro-step's share of the window's loss: one micro-step, or its rows in a split() window."""
        return 1 if self._weights is None else self._rows[self._position - 1]

    def _ran_here(self, unit: int) -> None:
        self._backward_done = True
        self._ran.append(self._position)
        self._units += unit

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
        try:
            # with sync_each_batch the window holds synced gradients after its first micro-step, on every rank:
            # also where this rank skipped them all (a stand-in synced with the others)
            again = not (self.sync_each_batch and self._position > 1)
            status = self._target.stand_in(self._mark, self.sync_gradients, again) if self._target is not None \
                else ("dropped" if self._started else "replayed")
        except SyncError as failed:  # a synced backward failed part-way and could not be reduced again
            raise failed from exc
        if status == "resynced":  # the header went with the failed backward: read what it carried
            self._target.carry_with_next_sync(())
            carried = self._pending_carry
        if status != "replayed":  # a backward failed part-way: its partial gradients went with the window
            if self._target is None:
                for p in self.model.parameters():
                    p.grad = None
            self._records += [(k - 1, f"dropped with micro-step {step}: its backward failed part-way")
                              for k in self._ran]
            self._ran, self._units, self._items, self._sent = [], 0, None, (0.0, 0.0)
        if self._boundary:
            self._close(carried)
            if self.wrapped_optimizers and not self.window_empty:  # and the window's gradients, to see them cleared
                marks = [(p, stamp(p.grad)) for p in self.model.parameters() if p.grad is not None]
                self._owed = (f"window {self.windows - 1} closed with micro-step {step} skipped ({reason_of(exc)})", marks)

    def optimizer_acted(self) -> None:
        """A wrapped optimizer stepped where a window ends (``optim.py``); a zero_grad shows in the gradients' marks."""
        self._owed = None

    def data_ended(self) -> None:
        """Before the next window, and where ``iterate`` runs out: refuse a closed window whose optimizer lines
        this rank's skip jumped over (it would train on while the others stepped, or add the next window to it)."""
        if self._owed is not None:
            (owed, marks), self._owed = self._owed, None
            if marks and all(unchanged(mark, p.grad) for p, mark in marks):  # nothing stepped nor cleared them
                raise RuntimeError(
                    f"gradsync: on this rank {owed}, and neither optimizer.step() nor a zero_grad ran after it (its "
                    "gradients are as the synced backward left them): a skip leaves `with acc.accumulate():` at once, "
                    "so the lines after it inside the block do not run on the rank that skipped, while the other "
                    "ranks step. Call optimizer.step(), scheduler.step() and optimizer.zero_grad() after the block.")

    def state_dict(self) -> dict[str, Any]:
        """The window's position and normalization state (``Windows``), and the noise scale's running sums."""
        state = super().state_dict()
        if self.noise.scale is not None:  # "over every window so far": a resumed run or a joiner goes on from them
            state["noise_scale"] = (self.noise.scale.trace_sum, self.noise.scale.norm2_sum, self.noise.scale.windows)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.noise.scale is not None and "noise_scale" in state:
            self.noise.scale.trace_sum, self.noise.scale.norm2_sum, self.noise.scale.windows = state["noise_scale"]

    # ---------------------------------------------------------------- wrappers
    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Return ``optimizer`` whose ``step()``/``zero_grad()`` act only where a window ends.

        ``zero_grad()`` never clears the window in progress, so it may also sit at the top of the loop.
        """
        self.wrapped_optimizers.append(WindowOptimizer(optimizer, self))
        return self.wrapped_optimizers[-1]

    def wrap_scheduler(self, scheduler: Any) -> Any:
        """Return ``scheduler`` whose ``step()`` acts once per window, at its end."""
        self.wrapped_schedulers.append(WindowScheduler(scheduler, self))
        return self.wrapped_schedulers[-1]

    @property
    def noise_scale(self) -> float | None:
        """B_simple = tr(Sigma) / |G|^2 (noise.py), in items (num_items) or micro-batches, over every
        window so far; the same on every rank. None until a window gave an estimate (or noise_scale=False)."""
        return None if self.noise.scale is None else self.noise.scale.value

    @property
    def grad_norm(self) -> float | None:
        """The closed window's global gradient norm (as ``clip_grad_norm_`` computes it); read it after the
        window's optimizer step and before ``zero_grad()``. None inside a window."""
        if self._boundary and not self._active and self.windows:  # each read: a scaler or a clip changes them
            self.noise.grad_norm = self.noise.norm2() ** 0.5
        return self.noise.grad_norm

    def at_window_start(self) -> None:
        """Between windows, once per boundary: features that act there hear of it (``process.announce``)."""
        if self._boundary and not self._active and self._boundary_done != self.windows:
            process.announce("window", self)
            self._boundary_done = self.windows


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")
