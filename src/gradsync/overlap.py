"""The optimizer overlapped with communication: step each bucket's parameters once it is reduced.

``overlap_optimizer(model, optimizer)`` makes every synced backward of ``model`` step
``optimizer`` bucket by bucket: as soon as a bucket's reduction completes, its averaged
gradients are written back and the optimizer runs on that bucket's parameters while later
buckets are still in flight. ``optimizer.step()`` after such a backward does nothing, so an
unchanged loop (and ``GradientAccumulator.wrap_optimizer``, which steps only where a window
ends) keeps working. Only element-wise optimizers can be split this way: their update of a
parameter reads that parameter's gradient and state alone, so stepping the parameters in
groups gives the same result as one step over all of them.
"""
from __future__ import annotations

import types
import weakref
from typing import Any

import torch
from torch import nn

from . import process
from ._torch import claim_amp_scaling, foreach_mul_
from .ddp.seam import ReducerView, SyncTarget
from .accumulate.optim import WindowOptimizer

ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
               torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop)


class OverlappedStep:
    """The handle ``overlap_optimizer`` returns; ``remove()`` restores the plain loop."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        reducer = model.reducer if isinstance(model, SyncTarget) else None
        if not isinstance(reducer, ReducerView) or reducer.is_sharded:
            raise TypeError("gradsync: overlap_optimizer needs a gradsync.DistributedDataParallel model "
                            f"(got {type(model).__name__}); ShardedOptimizer already steps on the shards")
        if isinstance(optimizer, WindowOptimizer):  # the accumulator's wrapper: its step() calls this one's
            optimizer = optimizer.optimizer
        if type(optimizer) not in ELEMENTWISE:
            names = ", ".join(c.__name__ for c in ELEMENTWISE)
            raise TypeError(
                f"gradsync: overlap_optimizer cannot split {type(optimizer).__name__}.step() per bucket: only "
                f"element-wise optimizers ({names}) give the same result stepped bucket by bucket. "
                "Step this optimizer after backward as usual.")
        if reducer.bucket_reduced is not None:
            raise RuntimeError("gradsync: this model already overlaps an optimizer; remove() that one first")
        if (earlier := optimizer.__dict__.get("gradsync_overlap")) is not None:
            if not earlier.outlived():
                raise RuntimeError("gradsync: this optimizer already steps inside another model's backward "
                                   "(overlap_optimizer); remove() that handle first")
        if reducer.config.find_unused_parameters:
            raise ValueError(
                "gradsync: overlap_optimizer needs find_unused_parameters=False: which parameters got a "
                "gradient on some rank is known only after the last bucket, too late to step early")
        self._ids = frozenset(id(p) for p in reducer.params)
        # the model weakly: its finalizer holds the reducer, which holds this handle
        self._model, self.optimizer, self.reducer = weakref.ref(model), optimizer, reducer
        self._map_groups()
        self.stepped = False  # the latest synced backward stepped every bucket; step() is then a no-op
        self.rescale: Any = None  # an accumulator's window factor, asked before each bucket steps (None: no step)
        _STEPS[id(reducer)] = self
        self._plain_step = optimizer.step
        # an instance attribute (remove() deletes it), bound to the optimizer: torch's LR schedulers re-bind it there
        optimizer.step, optimizer.gradsync_overlap = types.MethodType(_overlapped_step, optimizer), self
        self._held_amp = claim_amp_scaling(optimizer)  # a GradScaler then calls step() every time: step() refuses it
        reducer.on_bucket_reduced(self._step_bucket)
        process.claim_clip_grad_norm(self)  # refuse clipping after an overlapped step (clip_grad_norm_for)

    @property
    def model(self) -> nn.Module | None:
        return self._model()

    def _map_groups(self) -> None:
        """Which group each parameter is in, again whenever the groups changed (``add_param_group``)."""
        groups = self.optimizer.param_groups
        foreign = [p for g in groups for p in g["params"] if id(p) not in self._ids]
        if foreign:
            raise ValueError(
                f"gradsync: the optimizer holds {len(foreign)} parameter(s) that the model does not reduce "
                "(another module's, or ones excluded from synchronization); overlap_optimizer steps only "
                "the model's buckets. Give those parameters their own optimizer.")
        self._group_of = {id(p): k for k, g in enumerate(groups) for p in g["params"]}
        self._sizes = [len(g["params"]) for g in groups]

    def _step_bucket(self, members: list[int]) -> None:
        if [len(g["params"]) for g in self.optimizer.param_groups] != self._sizes:
            self._map_groups()  # before any bucket steps: a parameter added since would never step
        if self.stepped:  # stepping again would apply the first backward's gradient twice: no loop does that
            raise RuntimeError(
                "gradsync: a second synced backward before optimizer.step() (two losses backpropagated one after "
                "the other, a GAN's generator loss through the discriminator, or a loop without optimizer.step(): "
                "with overlap_optimizer it steps nothing but marks where a step ends): each synced backward steps "
                "the optimizer, so the step would not see the gradients summed. Call optimizer.step() after each "
                "step's backward, sum the losses into one backward, run the earlier ones under model.no_sync(), or "
                "remove overlap_optimizer.")
        params = [self.reducer.params[i] for i in members]
        last = members[-1] == self.reducer.buckets[-1].members[-1]
        factor = self.rescale() if self.rescale is not None else 1.0
        self.rescale = self.rescale if not last else None
        if factor is None:  # not the window's end (sync_each_batch), or a window that ran nowhere: no step
            return
        grads = [p.grad for p in params if p.grad is not None]
        if factor != 1.0 and grads:  # num_items, or skipped micro-steps: the window's mean, before the step
            foreach_mul_(grads, factor)
        groups = self.optimizer.param_groups
        kept = [g["params"] for g in groups]
        try:
            for k, g in enumerate(groups):  # this bucket's parameters only; hyperparameters as they are now
                g["params"] = [p for p in params if self._group_of.get(id(p)) == k]
            self._plain_step()
        finally:
            for g, ps in zip(groups, kept):
                g["params"] = ps
        self.stepped = last or self.stepped

    def outlived(self) -> bool:
        """Its model was wrapped again (or is gone): remove this handle, so the optimizer steps after backward again."""
        model = self._model()
        if model is not None and not getattr(model, "superseded", False):
            return False
        self.remove()
        return True

    def step(self, closure: Any = None) -> Any:
        """``optimizer.step()`` under overlap: a no-op after a synced backward stepped every bucket; else it raises."""
        if self.outlived():  # the module's newer wrapper steps after its backward, unless overlapped anew
            return self.optimizer.step(closure)
        if "found_inf" in self.optimizer.__dict__:  # set by torch's GradScaler.step (claim_amp_scaling)
            raise RuntimeError(
                "gradsync: overlap_optimizer cannot serve a GradScaler: each bucket stepped inside the synced "
                "backward on the gradients as they were, scaled and not yet checked for inf/NaN, before the "
                "scaler could unscale them or skip the step. Remove overlap_optimizer (handle.remove()) to "
                "scale the loss, or use bf16 autocast, which needs no loss scaling.")
        if closure is not None:
            raise RuntimeError("gradsync: with overlap_optimizer the step happens inside the synced "
                               "backward; step(closure) cannot re-run it. Call backward, then step().")
        if not self.stepped:
            raise RuntimeError(
                "gradsync: optimizer.step() without a synced backward since the last step: with "
                "overlap_optimizer the optimizer steps inside each synced backward, bucket by bucket. "
                "Step only after the backward that synchronizes (e.g. the last micro-step of a window).")
        self.stepped = False
        return None

    def remove(self) -> None:
        """Step after backward again, as without ``overlap_optimizer``."""
        if self.reducer.bucket_reduced == self._step_bucket:
            self.reducer.on_bucket_reduced(None)
            _STEPS.pop(id(self.reducer), None)
        self.optimizer.__dict__.pop("step", None)
        self.optimizer.__dict__.pop("gradsync_overlap", None)
        claim_amp_scaling(self.optimizer, self._held_amp)  # a fused optimizer's own True comes back
        process.release_clip_grad_norm(self)

    def clip_grad_norm_for(self, params: list[torch.Tensor], *args: Any) -> None:
        """Asked by ``torch.nn.utils.clip_grad_norm_``: refuse once this backward's step was made."""
        self._refuse_late(params, "clip_grad_norm_")

    def clip_grad_value_for(self, params: list[torch.Tensor], *args: Any) -> None:
        """Asked by ``torch.nn.utils.clip_grad_value_``: refuse once this backward's step was made."""
        self._refuse_late(params, "clip_grad_value_")

    def _refuse_late(self, params: list[torch.Tensor], function: str) -> None:
        if self.stepped and any(id(p) in self._ids for p in params):
            raise RuntimeError(
                f"gradsync: {function} after a backward whose optimizer step overlap_optimizer "
                "already made, bucket by bucket: clipping now changes nothing, and a global norm "
                "cannot be known before the last bucket. Remove overlap_optimizer (handle.remove()) "
                "to clip.")


def _overlapped_step(optimizer: torch.optim.Optimizer, closure: Any = None) -> Any:
    return optimizer.gradsync_overlap.step(closure)


_STEPS: weakref.WeakValueDictionary[int, OverlappedStep] = weakref.WeakValueDictionary()  # by id(reducer)


def _window_rescale(model: Any, factor: Any) -> None:
    """An accumulator's window is about to sync: its buckets step only after ``factor()`` rescaled them."""
    step = _STEPS.get(id(getattr(model, "reducer", None)))
    if step is not None:
        step.rescale = factor


process.listen("window_rescale", _window_rescale)


def overlap_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> OverlappedStep:
    """Step ``optimizer`` on each bucket's parameters as soon as that bucket is reduced."""
    return OverlappedStep(model, optimizer)
