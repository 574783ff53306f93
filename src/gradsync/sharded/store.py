"""ZeRO-2-style sharded gradients: the bucket store behind ``ShardedDataParallel``.

The same interface as ``engine/store.py``'s ``BucketStore``, plugged into the same reducer.
Parameters live in one flat buffer per bucket, padded so that it splits into ``world_size`` equal
shards; rank r owns shard r. In a synced backward each parameter's gradient is copied into a
staging buffer for its bucket and ``.grad`` is released; ``sharded_launcher.py`` reduce-scatters
a full bucket and ``fold`` adds its average into this rank's shard accumulator (fp32 or wider).
Staging buffers are in use only while their bucket is being filled or reduced, and a small pool
keeps a few for the next buckets, so gradient memory is about 1/W of the model plus a few
buckets. Under ``no_sync`` gradients accumulate at full size in ``.grad`` and are
reduce-scattered once, at the next synced backward. An accumulator with ``skip_on`` keeps every staging
buffer and result until the control (``keep_window_apart``): a synced backward that fails part-way on one
rank is then reduce-scattered again without it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..engine.config import Caps
from ..engine.checks import Graphs, check_grad
from ..engine.layout import plan_buckets
from ..engine.main_grad import MainGrads
from ..engine.store import Bucket, BucketStore
from .comm import BufferPool, exchanges, fold
from .regroup import mirror_shards, reshard


@dataclass
class ShardedBucket(Bucket):
    offsets: list[int] = field(default_factory=list)  # members' offsets in the flat buffers
    numel: int = 0  # padded: a multiple of the world size
    flat_param: torch.Tensor | None = None  # parameters are views of this
    grad_shard: torch.Tensor | None = None  # this rank's averaged gradient, accumulated
    out: torch.Tensor | None = None  # reduce-scatter output while in flight
    shard_zero: bool = True  # grad_shard is all zeros (nothing folded since zero_grad)
    mirror_shard: torch.Tensor | None = None  # mirror_shards(): the next rank's averaged gradient, accumulated
    shift: list | None = None  # mirrored on CPU: the pass in flight of the shards' averages (pass_on)

    @property
    def shard_numel(self) -> int:
        return self.grad_shard.numel()


class ShardedBucketStore:
    replans = False  # parameters live in bucket-shaped buffers laid out at construction
    sharded = True
    # copy_in releases .grad into the staging buckets, which keep_window_apart() keeps until the control
    keeps_local_grads = property(lambda self: self.apart)
    apart = False
    copies_per_bucket = False  # each gradient as it is ready: its .grad is released at once
    keeps_local_per_grad = True
    adopts_views = False
    exclusive = True  # only ShardedOptimizer may step these parameters (.grad is None after a sync)
    gathers = None  # ShardedOptimizer(prefetch=True)'s pending parameter all-gathers (sharded_prefetch.py)

    def keep_window_apart(self) -> None:
        """A synced backward that fails part-way is reduced again (``skip_on``): each bucket's staging buffer (the
        window) and reduce-scatter result are kept until the control, the results added to the shards after it."""
        self.apart = True

    def refill(self, failed_here: bool) -> None:
        """Before the window is reduced again without the failed ranks: their staging buffers hold nothing of it,
        and the first reduction's results are dropped."""
        for b in self.buckets:
            if failed_here and b.buffer is not None:
                b.buffer.zero_()
            if b.out is not None:
                self.track(-b.out.numel() * b.out.element_size())
                self.pool.give(b.out)
                b.out = None

    mirror = False  # mirror_shards(): rank r also holds shard (r + 1) % W, for a member that leaves (regroup.py)
    mirrored = property(lambda self: self.mirror and self.world_size > 1)
    mirror_rank = property(lambda self: (self.rank + 1) % self.world_size)  # whose shard this rank mirrors
    optimizer = None  # a weak reference to the ShardedOptimizer of these shards: regroup() carries its state
    restaged: frozenset[int] = frozenset()  # parameters whose window regroup() carried into new staging buffers
    mirror_shards = mirror_shards
    regroup = reshard  # (group, rank, world_size, wait, contributes): the members changed; a collective

    def __init__(self, params: list[torch.Tensor], names: list[str], *, rank: int, world_size: int, caps: Caps,
                 reduce_dtype: torch.dtype | None = None, pool_size: int = 6):
        self.params, self.names = params, names
        self.rank, self.world_size = rank, world_size
        self.caps = caps
        self.reduce_dtype = reduce_dtype
        self.plan_order = None
        self.pool = BufferPool(limit=pool_size)  # about the staging peak: in flight, being filled
        self.has_grad = [False] * len(params)  # got a gradient (on some rank) since zero_grad
        self.staged: set[int] = set()  # parameters copied into the staging buffers since the backward began
        self.partial = False  # a synced backward failed: the shards may hold part of its sum
        self._partial_before = False
        self.staging_bytes = self.peak_staging_bytes = 0
        self.lay_out(plan_buckets(params, *caps))
        # how a bucket is reduce-scattered on this device (comm.py): the launcher starts it, the fold adds it up
        self.exchange = exchanges(self.buckets[0].flat_param.device)
        self.main, self.graphs = None, Graphs()  # graphs: BucketStore.begin_sync's; a shard's stays empty
        if reduce_dtype is not None:
            self.main = MainGrads(params, names, self.slot, world_size=world_size, grad_is_slot=False)

    def lay_out(self, plan: list[list[int]], flats: list[torch.Tensor] | None = None) -> None:
        """Lay the buckets out for this world size; ``flats``: each bucket's parameters, flat (else the parameters')."""
        n = len(self.params)
        self.buckets: list[ShardedBucket] = []
        self.bucket_of, self.offset_of = [0] * n, [0] * n
        for b, members in enumerate(plan):
            first = self.params[members[0]]
            total = sum(self.params[i].numel() for i in members)
            padded = -(-total // self.world_size) * self.world_size
            flat = torch.zeros(padded, dtype=first.dtype, device=first.device)
            offsets, offset = [], 0
            for i in members:
                p = self.params[i]
                view = flat[offset:offset + p.numel()].view(p.shape)
                view.copy_(p.detach() if flats is None else flats[b][offset:offset + p.numel()].view(p.shape))
                p.data = view  # the post-step all-gather then writes the parameters in place
                self.bucket_of[i], self.offset_of[i] = b, offset
                offsets.append(offset)
                offset += p.numel()
            acc_dtype = torch.promote_types(torch.promote_types(first.dtype, torch.float32),
                                            self.reduce_dtype or first.dtype)
            grad_shard = torch.zeros(padded // self.world_size, dtype=acc_dtype, device=first.device)
            self.buckets.append(ShardedBucket(b, list(members), None, [], offsets=offsets, numel=padded, flat_param=flat,
                                              grad_shard=grad_shard, mirror_shard=grad_shard.clone() if self.mirrored else None))
        self._param_ptrs = [p.data_ptr() for p in self.params]

    def plan(self) -> list[list[int]]:
        return [list(b.members) for b in self.buckets]

    def replan(self, order: list[int], caps: Caps | None = None) -> None:
        raise RuntimeError("gradsync: sharded buckets cannot be rebuilt")

    def nbytes(self, bucket: ShardedBucket) -> int:
        return bucket.numel * bucket.flat_param.element_size()

    # ---------------------------------------------------------------- staging memory
    def slot(self, i: int) -> torch.Tensor:
        """Return parameter ``i``'s slot in its bucket's staging buffer, allocating the buffer."""
        bucket = self.buckets[self.bucket_of[i]]
        if bucket.buffer is None:
            if self.reduce_dtype is None:
                bucket.buffer = self.take(bucket.numel, bucket.flat_param.dtype, bucket.flat_param.device)
                end = bucket.offsets[-1] + self.params[bucket.members[-1]].numel()
                bucket.buffer[end:].zero_()  # padding
            else:  # also the window's accumulation buffer
                bucket.buffer = self.take(bucket.numel, self.reduce_dtype, bucket.flat_param.device).zero_()
            self.track(self.staged_nbytes(bucket))
        p = self.params[i]
        return bucket.buffer[self.offset_of[i]:self.offset_of[i] + p.numel()].view(p.shape)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.pool.take(numel, dtype, device)

    def staged_nbytes(self, bucket: ShardedBucket) -> int:
        return sum(t.numel() * t.element_size() for t in (bucket.buffer, bucket.out) if t is not None)

    def track(self, delta: int) -> None:
        """Account staging memory (buckets being filled or reduced), for benchmarks and tests."""
        self.staging_bytes += delta
        self.peak_staging_bytes = max(self.peak_staging_bytes, self.staging_bytes)

    def fold(self, bucket: ShardedBucket) -> None:
        """Add ``bucket``'s finished reduce-scatter to its shard and free the staging buffers (kept apart: at
        ``end_sync``, once the control showed that no rank failed)."""
        if self.apart:
            bucket.handle = None
        else:
            self.add_to_shard(bucket)

    def add_to_shard(self, bucket: ShardedBucket) -> None:
        if self.mirrored:  # this rank's average and its mirror's: pass_on's pair, else the bucket's sum (all-reduced)
            w = self.world_size
            shards = bucket.out.view(2, -1) if self.exchange else bucket.out.div_(w).view(w, -1)
            own, mirror = (0, 1) if self.exchange else (self.rank, self.mirror_rank)
            for shard, average in ((bucket.grad_shard, shards[own]), (bucket.mirror_shard, shards[mirror])):
                shard.copy_(average) if bucket.shard_zero else shard.add_(average)  # zeroed together (zero_grad)
        else:
            fold(bucket.grad_shard, bucket.out, self.world_size, self.exchange, bucket.shard_zero)
        bucket.shard_zero = False
        self.track(-self.staged_nbytes(bucket))
        self.pool.give(bucket.buffer, bucket.out)
        bucket.buffer = bucket.out = bucket.handle = None

    # ---------------------------------------------------------------- gradients in and out
    def copy_in(self, i: int, divide: bool) -> None:
        """Stage parameter ``i``'s gradient (the fold, or off CPU the launch, divides: not here)."""
        if self.main is not None:
            self.main.copy_in(i, divide=False)
            return
        p = self.params[i]
        view = self.slot(i)
        grad = p.grad
        self.staged.add(i)
        if grad is None:
            if i not in self.restaged:  # else the slot holds the window, carried from the group before (regroup.py)
                view.zero_()
        else:
            check_grad(grad, view, self.names[i])
            view.copy_(grad)
            p.grad = None  # the full-size gradient is not kept: its bucket holds it until reduced

    def keep_local(self, i: int) -> None:
        if self.main is not None:
            self.main.release_grad(i)

    def write_back(self, bucket: ShardedBucket, result: None, counts: list[int]) -> None:
        """The average is in the shard already; note which parameters got a gradient."""
        for i in bucket.members:
            if self.main is not None:
                self.main.fresh[i] = True
            if counts[i] > 0:  # unused on every rank: like torch, the optimizer skips it
                self.has_grad[i] = True

    def drop_local(self) -> None:
        """Drop every local gradient (``.grad`` and ``reduce_dtype``'s window buffers); shards stay."""
        for p in self.params:
            p.grad = None
        self._drop_main()

    def _drop_main(self) -> None:
        """Drop ``reduce_dtype``'s local accumulation of the window."""
        if self.main is None:
            return
        self.main.forget_window()
        for b in self.buckets:
            self.track(-self.staged_nbytes(b))
            if b.handle is None:  # else a failed backward left it in flight: not reusable
                self.pool.give(b.buffer)
            b.buffer = None

    def has_local_grad(self, i: int) -> bool:
        return self.params[i].grad is not None or (self.main is not None and not self.main.fresh[i])

    def grad_tensors(self) -> list[torch.Tensor]:
        """Every tensor holding gradient: the shards, pending local gradients, ``reduce_dtype``'s window."""
        tensors = [b.grad_shard for b in self.buckets]
        tensors += [p.grad for p in self.params if p.grad is not None]
        return tensors + [b.buffer for b in self.buckets if b.buffer is not None]

    # ---------------------------------------------------------------- the reducer's phases
    def begin_backward(self, syncing: bool) -> None:
        if self.gathers is not None:  # the forward waited already, unless it bypassed the wrapper
            self.gathers.wait_all()
        self._partial_before, self.restaged, self.staged = self.partial, frozenset(), set()
        if syncing:
            self.partial = True  # until this backward's end-of-backward check passes

    begin_sync = BucketStore.begin_sync  # the same on shards: every bucket waits for its members again
    copy_in_all = BucketStore.copy_in_all

    def end_sync(self, results: list[Any] | None, counts: list[int], done: Any = None) -> None:  # done: no overlap here
        for bucket, result in zip(self.buckets, results or ()):
            if self.apart and bucket.out is not None:
                self.add_to_shard(bucket)
            self.write_back(bucket, result, counts)
        self.partial, self.staged = self._partial_before, set()  # only zero_grad() clears an earlier failure

    def reset(self) -> None:
        for b in self.buckets:
            self.track(-self.staged_nbytes(b))
            b.buffer = b.out = b.handle = b.shift = None

    def release(self) -> None:
        if self.main is not None:
            self.main.release()

    # ---------------------------------------------------------------- gradient shards
    def shard_range(self, bucket: ShardedBucket, shard: int | None = None) -> tuple[int, int]:
        """Return the [start, end) range of ``bucket``'s flat buffer that this rank owns (or rank ``shard``)."""
        size, shard = bucket.shard_numel, self.rank if shard is None else shard
        return shard * size, (shard + 1) * size

    def zero_grad(self, set_to_none: bool = True) -> None:
        for b in self.buckets:
            b.grad_shard.zero_()
            b.shard_zero = True
            if b.mirror_shard is not None:
                b.mirror_shard.zero_()
        if set_to_none:
            self.has_grad = [False] * len(self.params)
        self.partial = False
        self._drop_main()
        for p in self.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    def check_params_in_place(self) -> None:
        """Raise if a parameter no longer lives in its bucket's flat buffer."""
        moved = [self.names[i] for i, p in enumerate(self.params) if p.data_ptr() != self._param_ptrs[i]]
        if moved:
            raise RuntimeError(
                f"gradsync: parameter(s) {', '.join(moved[:10])} no longer live in ShardedDataParallel's "
                "flat buffers (the module was moved with .to()/.cuda(), or parameter data was replaced). "
                "Updates would not reach them; move or change the module before wrapping it.")

    def check_ready_to_step(self) -> None:
        """Raise unless the shards hold a complete, synchronized gradient."""
        if self.partial:
            raise RuntimeError(
                "gradsync: the last synchronizing backward failed part-way, so the gradient shards are "
                "incomplete. Call optimizer.zero_grad() and redo the accumulation window.")
        pending = [self.names[i] for i in range(len(self.params)) if self.has_local_grad(i)]
        if pending:
            raise RuntimeError(
                f"gradsync: {len(pending)} parameter(s) (e.g. '{pending[0]}') hold gradients from "
                "micro-steps under no_sync() that were not reduce-scattered yet. Run the window's last "
                "backward with gradient sync enabled before optimizer.step().")
        self.check_params_in_place()

    def check_foreign_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Raise: an optimizer other than ``ShardedOptimizer`` steps these parameters."""
        raise RuntimeError(
            f"gradsync: {type(optimizer).__name__}.step() got parameters of a ShardedDataParallel "
            "model. Their averaged gradients live in per-rank shards (.grad is None after a "
            "synchronizing backward), so a torch optimizer would skip them silently. Use "
            f"gradsync.ShardedOptimizer(model, torch.optim.{type(optimizer).__name__}, ...) instead.")


__all__ = ["ShardedBucket", "ShardedBucketStore"]
