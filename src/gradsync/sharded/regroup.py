"""A sharded model whose members change: each shard kept on two ranks, re-sharded over the new group.

A member that dies must not take its shard of the averaged gradient and of the optimizer state with it.
After ``mirror_shards()`` rank r also holds shard (r + 1) % W: on CPU each bucket's all-to-all is folded as
without mirroring, and rank r passes its shard of the average to rank r - 1 (``pass_on``: 1/W of the bucket
more on the wire); elsewhere each bucket is all-reduced. Rank r adds its own shard of the
average and the one it mirrors, and ``ShardedOptimizer`` steps both with the same inner optimizer
(``ShardedOptimizer.mirror``).
The price per rank: a second shard of the gradient accumulator, of the optimizer state and of fp32 master
weights, and twice the optimizer's work.

When the group changes (``reshard``: the survivors after a death, or the members and a joiner, at the same
point on every one of them), every member contributes what it holds in the old layout: its shard and the
one it mirrors (the parameters as the optimizer's masters, the gradient, the optimizer state). Every rank
takes each shard from its owner, or from its mirror where the owner left, lays the buckets out for the new
world size and keeps its new shards; the window in the staging buffers (a synced backward in flight, or
``reduce_dtype``'s accumulation) is carried over. A joiner contributes nothing. Two neighbours that leave
together take a shard with them: that raises.
"""
from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..engine.collectives import deserialized, serialized
from .comm import fold


def claim_optimizer(store: Any, optimizer: Any) -> Any:
    """Make ``optimizer`` the one ``ShardedOptimizer`` of ``store`` (its ``zero_grad`` clears every shard, and a
    re-shard carries one optimizer's state along); return the store."""
    if store.optimizer is not None and store.optimizer() is not None:
        gc.collect()  # one the user dropped may live on only in a reference cycle
    if store.optimizer is not None and store.optimizer() is not None:
        raise NotImplementedError(
            "gradsync: this ShardedDataParallel model already has a ShardedOptimizer, and a second one's zero_grad() "
            "would clear the first one's gradient shards before it steps. Give one ShardedOptimizer several "
            "param_groups (each with its own lr, betas, ...), or drop the first (del it) before building another.")
    store.optimizer = weakref.ref(optimizer)
    return store


def mirror_shards(store: Any) -> None:
    """Keep each shard on two ranks from now on (before a ``ShardedOptimizer`` is built on the store)."""
    if store.optimizer is not None:
        raise RuntimeError("gradsync: mirror the shards before building the ShardedOptimizer")
    store.mirror = True
    for b in store.buckets:
        b.mirror_shard = torch.zeros_like(b.grad_shard) if store.mirrored else None


def pass_on(store: Any, bucket: Any, group: Any) -> list[Any]:
    """On CPU, once ``bucket``'s all-to-all is in (every rank's copy of this rank's shard): sum this rank's average
    into the first half of a two-shard result and start sending it to the rank that mirrors it; the shard this rank
    mirrors arrives in the second half. Returns the work: an all-to-all with one peer each way, every rank in the same
    bucket order. Not a send and a receive: gloo closes every connection of the group when a timed wait on one runs
    out, and an elastic member waits in short slices, so a peer 0.1 s late to its pass broke the group."""
    s, w = bucket.shard_numel, store.world_size
    pair = store.take(2 * s, bucket.grad_shard.dtype, bucket.flat_param.device)
    own = pair[:s] if pair.dtype == bucket.out.dtype else pair[:s].zero_()  # else fold adds a wider sum into it
    fold(own, bucket.out, w, exchange=True, fresh=True)
    store.track(pair.numel() * pair.element_size() - bucket.out.numel() * bucket.out.element_size())
    store.pool.give(bucket.out)
    bucket.out, bucket.handle = pair, None
    sent, received = [0] * w, [0] * w
    sent[(store.rank - 1) % w], received[store.mirror_rank] = s, s
    return [dist.all_to_all_single(pair[s:], pair[:s], received, sent, group=group, async_op=True)]


def held(store: Any) -> dict[str, Any]:
    """What this rank holds in the current layout, on the CPU: its shard and the one it mirrors."""
    optimizer = store.optimizer() if store.optimizer is not None else None
    rank, world = store.rank, store.world_size
    shards = {}
    for shard, mirror in [(rank, False)] + ([(store.mirror_rank, True)] if store.mirrored else []):
        side = None if optimizer is None else optimizer.mirror if mirror else optimizer.own
        buckets = []
        for k, b in enumerate(store.buckets):
            start, end = store.shard_range(b, shard)
            value = b.flat_param[start:end] if side is None else side.masters[k]
            grad = b.mirror_shard if mirror else b.grad_shard
            buckets.append((value.detach().cpu().clone(), grad.detach().cpu().clone()))
        shards[shard] = {"buckets": buckets, "state": [] if side is None else optimizer.pieces_state(mirror)}
    return {"owner": rank, "world": world, "shards": shards, "has_grad": list(store.has_grad),
            "options": None if optimizer is None else optimizer.full_state([])["param_groups"]}


def chosen_shards(given: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each shard of the old layout from its owner, else from the rank that mirrored it."""
    chosen = []
    for shard in range(given[0]["world"]):
        holders = [c for c in given if c["owner"] == shard] or [c for c in given if shard in c["shards"]]
        if not holders:
            raise RuntimeError(
                f"gradsync: shard {shard} of the ShardedDataParallel model (its gradient and optimizer state) was "
                "held only by replicas that left together (neighbours in the group, each keeping the other's "
                "shard); it cannot be recovered. Restart the job from a checkpoint.")
        chosen.append(holders[0]["shards"][shard])
    return chosen


def padded(flat: torch.Tensor, numel: int) -> torch.Tensor:
    out = torch.zeros(numel, dtype=flat.dtype)
    out[:min(numel, flat.numel())] = flat[:numel]
    return out


def gather(obj: Any, group: Any, world_size: int, wait: Callable[[Any, str], None]) -> list[Any]:
    """``obj`` of every rank of ``group`` (a CPU group), each wait bounded by ``wait`` (a member that dies
    meanwhile ends it at once, where ``all_gather_object`` would wait out the group's timeout)."""
    blob = serialized(obj)  # not pickle: its copies of GBs of optimizer state held the GIL (and stilled the heartbeat)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    wait(dist.all_gather(sizes, torch.tensor([blob.numel()]), group=group, async_op=True), "the re-shard's sizes")
    top = max(int(s) for s in sizes)
    out = [torch.empty(top, dtype=torch.uint8) for _ in range(world_size)]
    wait(dist.all_gather(out, torch.cat([blob, blob.new_zeros(top - blob.numel())]), group=group, async_op=True),
         "the re-shard")
    return [deserialized(o[:int(s)]) for o, s in zip(out, sizes)]


def reshard(store: Any, group: Any, rank: int, world_size: int, wait: Callable[[Any, str], None],
            contributes: bool = True) -> None:
    """Every member of ``group`` (a CPU group): rebuild the sharded model from what its members hold, laid out
    for ``world_size``, keeping this rank's shards (``contributes=False``: a joiner, which holds nothing yet).
    Nothing changes here until every contribution is in: a member that dies meanwhile leaves the old layout,
    to re-shard from again in the next group."""
    given = [c for c in gather(held(store) if contributes else None, group, world_size, wait) if c is not None]
    if not given:
        raise RuntimeError("gradsync: no member of the new group holds the sharded model's state")
    chosen = chosen_shards(given)
    nb = len(store.buckets)
    flats = [torch.cat([c["buckets"][k][0] for c in chosen]) for k in range(nb)]
    grads = [torch.cat([c["buckets"][k][1] for c in chosen]) for k in range(nb)]
    windows, carried = [b.buffer for b in store.buckets], set(store.staged) | set(store.restaged)
    before = store.staging_bytes
    store.rank, store.world_size = rank, world_size
    store.lay_out(store.plan(), flats)
    store.has_grad = list(given[0]["has_grad"])
    store.staging_bytes = 0
    for b, grad, window in zip(store.buckets, grads, windows):
        grad = padded(grad, b.numel)
        b.grad_shard.copy_(grad[slice(*store.shard_range(b))])
        if b.mirror_shard is not None:
            b.mirror_shard.copy_(grad[slice(*store.shard_range(b, store.mirror_rank))])
        b.shard_zero = False
        # the window goes on in the new layout: a synced backward in progress (copy_in keeps it), or reduce_dtype's
        # accumulation, which lives in the buffers from the window's first micro-step on
        if carried or (store.main is not None and window is not None):
            b.buffer = store.take(b.numel, store.reduce_dtype or b.flat_param.dtype, b.flat_param.device).zero_()
            if window is not None:
                b.buffer[:min(b.numel, window.numel())].copy_(window[:b.numel])
            store.track(store.staged_nbytes(b))
    store.restaged, store.peak_staging_bytes = frozenset(carried), max(store.peak_staging_bytes, before)
    optimizer = store.optimizer() if store.optimizer is not None else None
    if optimizer is not None:
        optimizer.lay_sides([padded(f, b.numel).to(b.flat_param.device) for f, b in zip(flats, store.buckets)])
        state = optimizer.full_state([piece for c in chosen for piece in c["state"]])
        optimizer.load_state_dict({"state": state["state"], "param_groups": given[0]["options"]})


__all__ = ["chosen_shards", "claim_optimizer", "held", "mirror_shards", "pass_on", "reshard"]
