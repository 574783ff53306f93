"""torch's ``delay_all_reduce_named_params``: some parameters are averaged apart from the buckets."""
from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .._torch import queue_end_of_backward


class DelayedAllReduce:
    """Average ``params``' gradients in one flat all-reduce once ``trigger``'s gradient is ready.

    The reducer does not see these parameters (no bucket, no unused-parameter tracking). torch
    starts the all-reduce from ``trigger``'s gradient hook; gradsync starts it when that backward
    ends, after the reducer's own collectives, so collectives keep one order on every rank, and
    only in a backward that synchronizes (inside ``no_sync`` the gradients accumulate locally).
    """

    def __init__(self, ddp: Any, params: Sequence[torch.Tensor], trigger: torch.Tensor):
        self.params = list(params)
        self._ddp = weakref.ref(ddp)
        self._syncs_before: int | None = None
        self._handle = trigger.register_hook(self._on_trigger_grad)

    def remove(self) -> None:
        self._handle.remove()

    def prepare_for_forward(self) -> None:
        if torch.is_grad_enabled():  # a no-grad forward may run in another thread while a backward runs
            self._syncs_before = None  # a backward that raised before its end left this set

    def _on_trigger_grad(self, grad: torch.Tensor) -> None:
        ddp = self._ddp()
        if ddp is not None and self._syncs_before is None:
            self._syncs_before = ddp.reducer.sync_count
            queue_end_of_backward(self._after_reducer)

    def _after_reducer(self) -> None:
        # queued once more: the reducer's end-of-backward may have been queued after this callback
        queue_end_of_backward(self._reduce)

    def _reduce(self) -> None:
        before, self._syncs_before = self._syncs_before, None
        ddp = self._ddp()
        if ddp is not None and ddp.reducer.sync_count != before:  # this backward synchronized
            self.reduce_now(ddp)

    def grads(self) -> list[torch.Tensor]:
        """These parameters' gradients: the accumulator rescales them with the buckets' (``scale_grads_``)."""
        return [p.grad for p in self.params if p.grad is not None]

    def drop_local(self) -> None:
        """A skipped micro-step's backward failed part-way: drop these parameters' window, as the reducer does."""
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def reduce_now(self, ddp: Any) -> None:
        """Average these parameters' window over the ranks (a skipping rank's stand-in calls it as the others'
        backward did)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads]).div_(ddp.world_size)
        ddp.wait(dist.all_reduce(flat, group=ddp.process_group, async_op=True),
                  "the all-reduce of delay_all_reduce_named_params")
        for p, part in zip(self.params, flat.split([p.numel() for p in self.params])):
            if p.grad is None:
                p.grad = part.view_as(p).clone()
            else:
                p.grad.copy_(part.view_as(p))
