"""reduce_dtype with ShardedDataParallel: fp32 staging, reduce-scatter and shards; fp32 master weights.

Reference: the fp64 sum of the same per-micro-step bf16 gradients over micro-steps and ranks (see
tests/engine/test_reduce_dtype.py), one SGD step on fp64 weights; tolerances as stated there.
"""
import pytest
import torch

import gradsync
from gradsync.tools.launch import run_ranks
from helpers import batches, mlp
from bf16 import exact_window, loss_on, rel_err

CAPS = dict(bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005)
TOL = 1e-6

LR = 0.5


def sharded_window(rank, world_size, steps, sync_each_batch, reduce_dtype):
    model = gradsync.ShardedDataParallel(mlp(seed=0, dtype=torch.bfloat16), reduce_dtype=reduce_dtype, **CAPS)
    opt = gradsync.ShardedOptimizer(model, torch.optim.SGD, lr=LR)
    acc = gradsync.GradientAccumulator(model, steps, sync_each_batch=sync_each_batch)
    opt = acc.wrap_optimizer(opt)
    data = batches(steps, world_size, seed=3)
    exact = exact_window(data, world_size)
    reducer = model.reducer
    start0 = {n: p.detach().double() for n, p in model.module.named_parameters()}
    for x, y in data:
        with acc.accumulate():
            acc.backward(loss_on(model, x, y, rank, world_size))
            if acc.is_boundary:
                shard_err = 0.0
                for b in reducer.buckets:
                    whole = torch.zeros(b.numel, dtype=torch.float64)
                    for i, off in zip(b.members, b.offsets):
                        whole[off:off + reducer.params[i].numel()] = exact[reducer.names[i]].reshape(-1)
                    start, end = reducer.store.shard_range(b)
                    shard_err = max(shard_err, rel_err(b.grad_shard, whole[start:end]))
            opt.step()
            opt.zero_grad()
    masters = opt.optimizer._masters
    stepped = {n: start0[n] - LR * exact[n] for n in exact}
    for n, p in model.module.named_parameters():  # the bf16 parameters are the fp32 masters, rounded
        assert rel_err(p.detach(), stepped[n]) < 2 ** -8, n  # within bf16 rounding
    return shard_err, {m.dtype for m in masters}


@pytest.mark.parametrize("sync_each_batch", [False, True])
def test_sharded_accumulates_and_steps_from_fp32(sync_each_batch):
    for err, masters in run_ranks(sharded_window, 2, 8, sync_each_batch, torch.float32):
        assert err < TOL and masters == {torch.float32}
    bf16 = run_ranks(sharded_window, 2, 8, sync_each_batch, None)
    if sync_each_batch:  # on CPU each micro-step's copies are summed in the fp32 shard (sharded_comm.py)
        assert all(err < TOL for err, _ in bf16), bf16
    else:  # the window accumulates in bf16 .grad first
        assert all(err > 100 * TOL for err, _ in bf16), bf16
