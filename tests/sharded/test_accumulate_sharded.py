"""The accumulator drives every wrapper the same way: sharded models, num_items, both sync modes."""
import pytest
import torch

import gradsync
from gradsync.tools.launch import run_ranks
from helpers import assert_close_dicts, batches, item_counts, micro_steps, mlp, params, reference, reference_items

CAPS = dict(bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)


def sharded_items(rank, world_size, sync_each_batch, micro, steps, rows):
    model = gradsync.ShardedDataParallel(mlp(seed=rank), **CAPS)
    acc = gradsync.GradientAccumulator(model, steps=steps, sync_each_batch=sync_each_batch)
    opt = acc.wrap_optimizer(gradsync.ShardedOptimizer(model, torch.optim.SGD, lr=0.1))
    seen = [params(model.module)  # before each micro-step's optimizer step, then at the end
            for _ in micro_steps(model, acc, opt, rank, world_size, batches(micro, world_size, per_rank=rows),
                                 item_counts(micro, world_size, rows))] + [params(model.module)]
    moved = [any(not torch.equal(a[p], b[p]) for p in a) for a, b in zip(seen, seen[1:])]
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
    for _ in micro_steps(model, acc, opt, rank, world_size, batches(micro, world_size)):
        pass
    return params(model.module)


@pytest.mark.parametrize("sync_each_batch", [False, True])
def test_sharded_model_with_mean_losses_equals_one_process(sync_each_batch):
    micro, steps = 10, 4  # optimizer steps after 4, 8 and 10
    results = run_ranks(sharded_mean_loss, 2, sync_each_batch, micro, steps)
    model = mlp(seed=0)
    reference(model, batches(micro, 2), steps, torch.optim.AdamW(model.parameters(), lr=0.01))
    for final in results:
        assert_close_dicts(final, params(model))
