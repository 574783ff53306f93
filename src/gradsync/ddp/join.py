"""Uneven inputs: torch's join protocol (``torch.distributed.algorithms.Join``) for the wrapper.

The wrapper is a ``Joinable``: ``with model.join():`` and ``with Join([model, optimizer]):``
(e.g. with torch's ``ZeroRedundancyOptimizer``) let ranks with fewer batches finish early. Each
forward of an active rank first calls ``Join.notify_join_context`` (one all-reduce, which a
joined rank's ``Join`` pairs with its count of non-joined ranks, and which raises everywhere
with ``throw_on_early_termination``). Then comes gradsync's handshake: a joined rank cannot tell
from its own state whether an active rank's next backward will synchronize, so each active rank
sets its own slot to 1 and adds whether this forward's backward syncs and whether it broadcasts
buffers; a joined rank's ``main_hook`` adds zeros. From the sum every rank learns who is active
and what follows, and a joined rank shadows exactly those collectives: the buffer broadcast
(from the highest active rank, as torch's) and, when the backward syncs, every bucket's collective with zero
gradients plus the end-of-backward check, each preceded by a phase header with an empty row
(``header.py``). Once every rank has joined, ``post_hook`` copies the
parameters (and buffers, when they sync at runtime) from the highest rank among the last active
ones, as torch does. Gradients divide by the full world size (zeros from joined ranks) unless
``divide_by_initial_world_size=False``, which divides by the number of active ranks.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join as TorchJoin, JoinHook

from .._torch import join_enabled, set_authoritative_rank, set_join_config_disabled
from ..engine.launcher import one_collective
from ..engine.errors import SyncError
from ..engine.shadow import shadow_backward


class DDPJoinHook(JoinHook):
    """The wrapper's join hook; while a join is configured it is also the wrapper's ``join_state``."""

    def __init__(self, ddp: Any, divide_by_initial_world_size: bool = True):
        if ddp.delayed is not None:
            raise NotImplementedError(
                "gradsync: join() does not shadow the delayed all-reduce of "
                "delay_all_reduce_named_params; give every rank the same number of batches")
        if ddp.reducer.config.deterministic:  # a joined rank's zeros would be leaves of the tree, and change it
            raise NotImplementedError(
                "gradsync: join() with deterministic=True is not supported: the window's tree is over every global "
                "micro-batch, dealt rank j // k; give every rank the same number of micro-batches")
        if ddp.reducer.attached is not None:  # torch's Join all-reduces outside the commit protocol's reach
            raise NotImplementedError(
                "gradsync: join() is not supported on a model whose members may change (gradsync.elastic): a replica "
                "dying inside it would leave the others in torch's join all-reduces. ElasticSampler deals every "
                "member the same number of micro-batches; without it, give every replica the same number of batches")
        self.ddp = ddp
        self.last_active = list(range(ddp.world_size))  # ranks active in the latest handshake with any
        self.expect_sync: bool | None = None
        self.handshakes = 0  # this rank's, as an active rank
        self.divides_by_active = False  # the accumulator's window rescale reads it (accumulate/close.py)
        reducer = ddp.reducer
        if not divide_by_initial_world_size and reducer.launcher.hook is None:
            # like torch, the divisor applies to the default reduction only; a user's hook divides itself
            reducer.launcher.set_hook(average_over_active_ranks, self)
            self.divides_by_active = True
        ddp.join_state = self
        reducer.backward_check = self.check_backward

    def close(self) -> None:
        """Leave join mode: the next forwards run without handshakes."""
        ddp = self.ddp
        if ddp.join_state is not self:
            return
        ddp.join_state = None
        ddp.reducer.backward_check = None
        set_join_config_disabled(ddp)
        ddp.reducer.plane.set_active(None)
        if self.divides_by_active and ddp.reducer.launcher.hook is average_over_active_ranks:
            ddp.reducer.launcher.set_hook(None, None)

    # ------------------------------------------------------------ active rank
    def before_forward(self) -> int:
        """Notify the join context and run the handshake for one forward; return the buffer source rank."""
        ddp = self.ddp
        work = TorchJoin.notify_join_context(ddp)  # raises here with throw_on_early_termination
        if work is not None:
            ddp.reducer.wait(work, "the join notification")
        will_sync = ddp.require_backward_grad_sync and torch.is_grad_enabled()
        self.handshakes += 1  # a micro-step skipped before it (replay.py) runs it in its stand-in
        active, syncs, _ = self._handshake(True, will_sync, ddp.will_broadcast_buffers())
        ddp.reducer.plane.set_active(active)
        self.expect_sync = syncs if torch.is_grad_enabled() else None
        return active[-1]  # the highest active rank, as torch: rank 0 may have joined, its buffers stale

    def check_backward(self, sync: bool) -> None:
        if not join_enabled(self.ddp):
            return
        if self.expect_sync is not None and sync != self.expect_sync:
            raise RuntimeError(
                "gradsync: inside model.join() the no_sync decision must be made before the forward "
                f"(the forward announced sync={self.expect_sync}, the backward has sync={sync}); "
                "wrap the forward in no_sync() too, or set require_backward_grad_sync before it"
            )
        self.expect_sync = None

    # ------------------------------------------------------------ joined rank
    def main_hook(self) -> None:
        """Shadow one forward (and its backward) of the ranks still active."""
        ddp = self.ddp
        active, syncs, broadcasts = self._handshake(False, False, False)
        if not active:
            raise SyncError(
                f"gradsync: joined rank {ddp.reducer.rank} expected a forward of the model on the active "
                "ranks and saw none: inside Join([...]) the model must come first, and each active "
                "rank's iteration must start with its forward")
        ddp.reducer.plane.set_active(active)
        buffers = list(ddp.module.buffers())
        if broadcasts and buffers:
            ddp.reducer.plane.exchange_header(0)
            ddp.broadcast_tensors(buffers, active[-1])
        if syncs:
            shadow_backward(ddp.reducer)

    def post_hook(self, is_last_joiner: bool) -> None:
        """Copy the model from a rank that was active longest, then leave join mode."""
        ddp, reducer = self.ddp, self.ddp.reducer
        source = max(self.last_active)
        set_authoritative_rank(ddp, source)
        tensors = list(ddp.module.parameters())
        if ddp.forward_sync_buffers:
            tensors += list(ddp.module.buffers())
        # the counters the end-of-backward check compares: joined ranks ran fewer passes
        counters = torch.tensor([reducer.counters.backward, reducer.counters.forward], device=reducer.device)
        ddp.broadcast_tensors(tensors + [counters], source)
        reducer.counters.backward, reducer.counters.forward = counters.tolist()
        self.close()

    def _handshake(self, active: bool, will_sync: bool,
                   broadcasts: bool) -> tuple[list[int], bool, bool]:
        ddp = self.ddp
        w, rank = ddp.world_size, ddp.reducer.rank
        plane = ddp.reducer.plane  # the control group: nothing read back from a device
        flags = torch.zeros(w + 2, dtype=torch.int64, device=plane.device)
        if active:
            flags[rank] = 1
            flags[w] = int(will_sync)
            flags[w + 1] = int(broadcasts)
        ddp.reducer.wait(dist.all_reduce(flags, group=plane.group, async_op=True),
                         "the join handshake")
        values = flags.tolist()
        ranks = [r for r in range(w) if values[r] == 1]
        if any(v not in (0, 1) for v in values[:w]) or (active and rank not in ranks):
            raise SyncError(f"gradsync: rank {rank}'s join handshake paired with a different "
                            "collective on another rank: the ranks ran different sequences of "
                            "collectives inside model.join()")
        if values[w] not in (0, len(ranks)):
            raise SyncError(
                f"gradsync: inside model.join(), ranks disagree about whether this backward "
                f"synchronizes ({values[w]} of {len(ranks)} active ranks will sync): one entered "
                "no_sync() (or disabled gradients) when another did not"
            )
        if values[w + 1] not in (0, len(ranks)):
            raise SyncError(
                f"gradsync: inside model.join(), {values[w + 1]} of {len(ranks)} active ranks broadcast "
                "buffers in this forward: the ranks disagree about train()/eval() mode"
            )
        if ranks:
            self.last_active = ranks
        return ranks, bool(values[w]), bool(values[w + 1])


class Join(TorchJoin):
    """``model.join()``'s context: torch's ``Join`` that also leaves join mode when the block raises."""

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            for hook in self._join_hooks:
                if isinstance(hook, DDPJoinHook):
                    hook.close()


@one_collective
def average_over_active_ranks(join: DDPJoinHook, bucket: Any) -> torch.futures.Future:
    """The default reduction with ``divide_by_initial_world_size=False``: sum / active ranks."""
    reducer = join.ddp.reducer
    active = reducer.plane.active_ranks
    buffer = bucket.buffer()
    buffer.mul_(1.0 / (len(active) if active else reducer.world_size))  # first: keeps sums in range; torch scales
    return dist.all_reduce(buffer, group=reducer.group, async_op=True).get_future().then(
        lambda fut: fut.value()[0])
