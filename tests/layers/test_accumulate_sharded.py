"""The accumulator drives every wrapper the same way: sharded models, num_items, both sync modes."""
import pytest
import torch
import torch.nn.functional as F

import gradsync
from gradsync.tools.launch import run_ranks
from helpers import assert_close_dicts, batches, mlp, params, shard
from test_accumulate import item_counts, item_losses, reference_items

CAPS = dict(bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)


def sharded_items(rank, world_size, sync_each_batch, micro, steps, rows):
    model = gradsync.ShardedDataParallel(mlp(seed=rank), **CAPS)
    acc = gradsync.GradientAccumulator(model, steps=steps, sync_each_batch=sync_each_batch)
    opt = acc.wrap_optimizer(gradsync.ShardedOptimizer(model, torch.optim.SGD, lr=0.1))
    counts = item_counts(micro, world_size, rows)
    moved = []
    for k, (x, y) in enumerate(acc.iterate(batches(micro, world_size, per_rank=rows))):
        before = params(model.module)
        with acc.accumulate():
            loss, n = item_losses(model, shard(x, rank, world_size), shard(y, rank, world_size), counts[k][rank])
            acc.backward(loss, num_items=n)
            opt.step()
            opt.zero_grad()
        moved.append(any(not torch.equal(before[p], v) for p, v in params(model.module).items()))
    return moved, params(model.module)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("sync_each_batch", [False, True])
def test_sharded_model_with_num_items_equals_one_process_on_all_items(world_size, sync_each_batch):
    micro, steps, rows = 7, 3, 5  # windows of 3, 3 and a short last one of 1
    results = run_ranks(sharded_items, world_size, sync_each_batch, micro, steps, rows)
    _, ref_final = reference_items(world_size, micro, steps, rows)
    for moved, final in results:
        assert moved == [False, False, True, False, False, True, True]  # only at window ends
        assert_close_dicts(final, ref_final)
    for _, final in results[1:]:
        for name in final:
            assert torch.equal(final[name], results[0][1][name])


def sharded_mean_loss(rank, world_size, sync_each_batch, micro, steps):
    model = gradsync.ShardedDataParallel(mlp(seed=rank), **CAPS)
    acc = gradsync.GradientAccumulator(model, steps=steps, sync_each_batch=sync_each_batch)
    opt = acc.wrap_optimizer(gradsync.ShardedOptimizer(model, torch.optim.AdamW, lr=0.01))
    for x, y in acc.iterate(batches(micro, world_size)):
        with acc.accumulate():
            acc.backward(F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)))
            opt.step()
            opt.zero_grad()
    return params(model.module)


@pytest.mark.parametrize("sync_each_batch", [False, True])
def test_sharded_model_with_mean_losses_equals_one_process(sync_each_batch):
    micro, steps = 10, 4  # optimizer steps after 4, 8 and 10
    results = run_ranks(sharded_mean_loss, 2, sync_each_batch, micro, steps)
    model = mlp(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = batches(micro, 2)
    for start in range(0, micro, steps):
        window = data[start:start + steps]
        for x, y in window:
            (F.mse_loss(model(x), y) / len(window)).backward()
        opt.step()
        opt.zero_grad()
    for final in results:
        assert_close_dicts(final, params(model))
