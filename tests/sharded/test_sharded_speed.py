"""The sharded engine's fast paths: CPU collectives, several reduce-scatters in flight under a budget."""
import pytest
import torch.distributed as dist
from torch import nn

import gradsync
from helpers import assert_close_dicts, batches, mlp, params
from test_sharded import CAPS, K, model, optimizers, window
from gradsync.tools.launch import run_ranks

NAMES = ("all_to_all_single", "broadcast", "reduce_scatter_single", "all_gather_single", "reduce_scatter_tensor",
         "all_gather_into_tensor")


def train(rank, world_size, ours, theirs, opt_a, opt_b, windows, how):
    data = batches(windows * K, world_size, per_rank=4)
    for w in range(windows):
        window(w, data, rank, world_size, [(ours, how), (theirs, "no_sync")])
        for opt in (opt_a, opt_b):
            opt.step()
            opt.zero_grad()


def counted(rank, world_size):
    calls = {n: 0 for n in NAMES}
    originals = {n: getattr(dist, n) for n in NAMES}

    def counting(n):
        def wrapper(*args, **kwargs):
            calls[n] += 1
            return originals[n](*args, **kwargs)
        return wrapper

    ours = gradsync.ShardedDataParallel(model(seed=rank), **CAPS)  # construction broadcasts: not counted
    theirs = nn.parallel.DistributedDataParallel(model(seed=rank))
    opt_a, opt_b = optimizers("adamw", ours, theirs)
    for n in NAMES:
        setattr(dist, n, counting(n))
    try:
        train(rank, world_size, ours, theirs, opt_a, opt_b, 2, "no_sync")
    finally:
        for n in NAMES:
            setattr(dist, n, originals[n])
    return calls, len(ours.reducer.buckets), params(ours.module), params(theirs.module)


def test_cpu_buckets_use_all_to_all_and_broadcasts():
    """gloo's reduce-scatter all-reduces the whole buffer and its all-gather copies through a
    staging buffer (sharded_comm.py): CPU buckets must not use them."""
    for calls, buckets, ours, theirs in run_ranks(counted, 3):
        assert_close_dicts(ours, theirs, atol=1e-5)
        assert calls["all_to_all_single"] == 2 * buckets  # one per bucket per synced backward
        assert calls["broadcast"] == 2 * 3 * buckets  # one per owner per bucket per step
        assert sum(calls[n] for n in NAMES[2:]) == 0, calls


SMALL = dict(bucket_cap_mb=0.0005, first_bucket_cap_mb=0.0005)  # about one parameter per bucket


def inflight(rank, world_size, max_inflight, budget_buckets):
    probe = gradsync.ShardedDataParallel(model(seed=0), **SMALL)
    biggest = max(b.numel for b in probe.reducer.buckets) * 4
    budget = None if budget_buckets is None else budget_buckets * biggest / 2**20
    ours = gradsync.ShardedDataParallel(model(seed=rank), max_inflight=max_inflight, staging_budget_mb=budget,
                                        **SMALL)
    theirs = nn.parallel.DistributedDataParallel(model(seed=rank))
    opt_a, opt_b = optimizers("sgd", ours, theirs)
    train(rank, world_size, ours, theirs, opt_a, opt_b, 3, "sync_each_batch")
    r = ours.reducer
    return params(ours.module), params(theirs.module), r.launcher.max_inflight_seen, r.store.peak_staging_bytes, biggest, \
        len(r.buckets)


@pytest.mark.parametrize("max_inflight,budget_buckets", [(4, None), (4, 3.5), (1, None)])
def test_reduce_scatters_in_flight_under_a_budget(max_inflight, budget_buckets):
    for ours, theirs, seen, peak, biggest, buckets in run_ranks(inflight, 2, max_inflight, budget_buckets):
        assert_close_dicts(ours, theirs, atol=1e-5)
        assert buckets > 4
        if budget_buckets is None:
            assert seen == max_inflight  # backward really keeps that many in flight
            assert peak <= (2 * max_inflight + 1.5) * biggest  # each: staging + all-to-all output
        else:  # the budget holds (up to the bucket being filled out of order) and still lets 1 through
            assert 1 <= seen < max_inflight and peak <= budget_buckets * biggest + biggest


def test_max_inflight_must_be_positive():
    with pytest.raises(ValueError, match="max_inflight"):
        gradsync.ShardedDataParallel(mlp(), max_inflight=0)


def interleaved(rank, world_size):
    ours = gradsync.ShardedDataParallel(model(seed=rank), **SMALL)
    theirs = nn.parallel.DistributedDataParallel(model(seed=rank))
    opt_a, opt_b = optimizers("adamw", ours, theirs)
    events = []
    broadcast, inner_step = dist.broadcast, opt_a.optimizer.step
    dist.broadcast = lambda *a, **k: events.append("gather") or broadcast(*a, **k)
    opt_a.optimizer.step = lambda *a, **k: events.append("step") or inner_step(*a, **k)
    try:
        train(rank, world_size, ours, theirs, opt_a, opt_b, 2, "no_sync")
    finally:
        dist.broadcast = broadcast
    return events, len(ours.reducer.buckets), params(ours.module), params(theirs.module)


def test_each_bucket_is_gathered_while_the_next_one_steps():
    for events, buckets, ours, theirs in run_ranks(interleaved, 2):
        assert_close_dicts(ours, theirs, atol=1e-5)
        one_step = events[:len(events) // 2]
        assert one_step.count("step") > 2 and one_step.count("gather") == 2 * buckets
        assert one_step.index("gather") < len(one_step) - 1 - one_step[::-1].index("step")  # not all at the end


def pooled(rank, world_size):
    ours = gradsync.ShardedDataParallel(model(seed=rank), **CAPS)
    theirs = nn.parallel.DistributedDataParallel(model(seed=rank))
    opt_a, opt_b = optimizers("adamw", ours, theirs)
    pool, known, new = ours.reducer.store.pool, set(), []
    take = pool.take

    def spy(numel, dtype, device):
        t = take(numel, dtype, device)
        new[-1] += t.data_ptr() not in known and numel >= 1000  # the big buckets (the last one is small)
        known.add(t.data_ptr())
        return t
    pool.take = spy
    for w in range(3):
        new.append(0)
        train(rank, world_size, ours, theirs, opt_a, opt_b, 1, "sync_each_batch")
    return params(ours.module), params(theirs.module), new, len(pool.free), pool.limit


def test_staging_buffers_are_reused_not_reallocated():
    """Fresh multi-MB CPU buffers cost page faults every step (sharded_comm.BufferPool)."""
    for ours, theirs, new, held, limit in run_ranks(pooled, 2):
        assert_close_dicts(ours, theirs, atol=1e-5)
        assert new[0] > 0 and new[-1] == 0, new  # steady state: every staging buffer comes from the pool
        assert held <= limit
