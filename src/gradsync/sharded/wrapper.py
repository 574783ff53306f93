"""``ShardedDataParallel``: the DDP wrapper over sharded gradients (ZeRO-2 style).

The reducer is the core's; sharding plugs in a different store (``sharded_store.py``: staging
buckets and gradient shards) and launcher (``sharded_launcher.py``: reduce-scatter). The optimizer
that steps the shards and all-gathers parameters is ``sharded_optim.py``.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch

from .. import process
from .._torch import dynamo_frame_callback_set
from ..ddp.grad_state import holds_window
from ..ddp.wrapper import DistributedDataParallel
from .prefetch import compiling
from ..engine.config import ReducerConfig
from ..engine.reducer import Reducer
from .launcher import ShardedLauncher
from .store import ShardedBucketStore
from .clip import claim_for_sharded, clip_shards, clip_shards_by_value, release_for_sharded

MAX_INFLIGHT = 2  # reduce-scatters in flight during backward: two let gloo's threads reduce two buckets


def _dynamo_active() -> bool:
    """True inside ``torch.compile``'s tracing or a compiled callable (Dynamo's frame callback is set)."""
    if compiling():
        return True
    return dynamo_frame_callback_set()


class ShardedDataParallel(DistributedDataParallel):
    """ZeRO-2-style data parallelism: each rank keeps 1/W of the averaged gradient.

    Same constructor and construction checks as ``DistributedDataParallel`` (without
    ``gradient_as_bucket_view``), plus ``max_inflight`` and ``staging_budget_mb``. Pair it with
    ``ShardedOptimizer``, which steps this rank's shard and all-gathers the parameters. ``no_sync()`` accumulates full-size local gradients
    and reduce-scatters them once; syncing every micro-step keeps gradient memory at ~1/W.
    ``reduce_dtype`` (e.g. ``torch.float32`` for bf16 parameters) stages, accumulates (also
    across ``no_sync`` micro-steps, at full size in that dtype) and reduce-scatters in that dtype;
    ``.grad`` is released as soon as it is added, and there is no ``param.main_grad``: the
    gradient lives in the fp32 shards.
    """

    sharded = True

    def __init__(self, module: torch.nn.Module, *args: Any, max_inflight: int = MAX_INFLIGHT,
                 staging_budget_mb: float | None = None, **kwargs: Any):
        """``max_inflight``: reduce-scatters in flight at once during backward; ``staging_budget_mb``:
        a bound on staging memory (buckets being filled or reduced) that launches also respect."""
        if int(max_inflight) < 1:
            raise ValueError(f"gradsync: max_inflight must be at least 1, got {max_inflight}")
        self._max_inflight = int(max_inflight)
        self._staging_budget_bytes = None if staging_budget_mb is None else int(staging_budget_mb * 2**20)
        super().__init__(module, *args, **kwargs)
        _skip_frames()

    def make_reducer(self, params: list[torch.nn.Parameter], names: list[str], config: ReducerConfig) -> Reducer:
        """The core's reducer over a sharded store and a reduce-scatter launcher."""
        group = self.process_group
        rank, world_size = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
        store = ShardedBucketStore(params, names, rank=rank, world_size=world_size, caps=config.caps,
                                   reduce_dtype=config.reduce_dtype, pool_size=2 * self._max_inflight + 2)
        reducer = Reducer(params, names, group, config, switch=self, store=store,
                          launcher=lambda plane: ShardedLauncher(group, plane, store, max_inflight=self._max_inflight,
                                                                 staging_budget_bytes=self._staging_budget_bytes))
        claim_for_sharded(reducer)
        weakref.finalize(self, release_for_sharded, reducer)
        return reducer

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        gathers = self.reducer.store.gathers
        if gathers is None or not gathers.active:
            return super().forward(*inputs, **kwargs)
        # the mode guards only the thread that stepped, and Dynamo would trace it: wait now
        if not gathers.guards_this_thread() or _dynamo_active() or type(self.module).__name__ == "OptimizedModule":
            gathers.finish()
        try:
            return super().forward(*inputs, **kwargs)
        finally:  # every all-gather done before the backward; the mode costs nothing from here on
            gathers.finish()

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        raise NotImplementedError(
            "gradsync: ShardedDataParallel reduce-scatters each bucket into per-rank shards; "
            "communication hooks (which return a fully reduced bucket) are not supported. Use "
            "gradsync.DistributedDataParallel to combine comm hooks with unsharded gradients."
        )

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False):
        if enable and self.world_size > 1:
            self.join_hook()  # raises
        return contextlib.nullcontext()  # disabled, or nothing to join on one rank

    def join_hook(self, **kwargs: Any):
        raise NotImplementedError(
            "gradsync: ShardedDataParallel does not support join() yet (a joined rank would have "
            "to shadow reduce-scatters and the optimizer's all-gathers). Give every rank the same "
            "number of batches (e.g. DistributedSampler(drop_last=True)), or use "
            "gradsync.DistributedDataParallel for uneven inputs."
        )

    def grad_state_dict(self) -> dict[str, Any]:
        """Return this rank's gradient shards and pending local gradients (rank-local state)."""
        reducer = self.reducer
        return {"local": super().grad_state_dict(), "has_grad": list(reducer.store.has_grad),
                "shards": [b.grad_shard.clone() for b in reducer.buckets], "world_size": self.world_size}

    def load_grad_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``grad_state_dict()`` of the same rank at the same world size."""
        if state["world_size"] != self.world_size:
            if not any(state["has_grad"]) and not any(bool(s.any()) for s in state["shards"]) \
                    and not holds_window(state["local"]):
                return  # saved between windows: nothing to restore (the layout is the one built here)
            raise ValueError(
                f"gradsync: this gradient state holds an unfinished window's shards, saved at world size "
                f"{state['world_size']}; it cannot load at {self.world_size}. Resume mid-window at the same world "
                "size, or checkpoint between windows (after zero_grad; the optimizer state loads at any world size)")
        super().load_grad_state_dict(state["local"])
        self.reducer.store.has_grad = list(state["has_grad"])
        for bucket, shard in zip(self.reducer.buckets, state["shards"]):
            bucket.grad_shard.copy_(shard)
            bucket.shard_zero = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradient shards too, as ``ShardedOptimizer.zero_grad`` does: ``nn.Module``'s would clear only
        ``.grad`` (None after a synced backward), and the next one would add onto the last step's gradient."""
        super().zero_grad(set_to_none)
        self.reducer.store.zero_grad(set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the sharded gradient by its global norm (across all ranks); return that norm.

        ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` does the same once a
        ``ShardedDataParallel`` exists; given only part of the parameters it raises.
        """
        return clip_shards(self.reducer, max_norm, norm_type, error_if_nonfinite)

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp the sharded gradient to [-clip_value, clip_value], as ``torch.nn.utils.clip_grad_value_`` does
        (which, given ``model.parameters()``, does the same once a ``ShardedDataParallel`` exists)."""
        clip_shards_by_value(self.reducer, clip_value)


def _skip_frames() -> None:
    """Dynamo runs the wrapper and the prefetch waits eagerly, as it runs ``gradsync.engine`` (ddp/compile.py)."""
    process.skip_in_dynamo(__name__)
    process.skip_in_dynamo(compiling.__module__)


__all__ = ["ShardedDataParallel"]
