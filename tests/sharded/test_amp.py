"""AMP loss scaling on a sharded model: gradsync.ShardedGradScaler against torch's DDP + torch's GradScaler."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradsync
from gradsync.sharded.amp import shard_grads
from gradsync.tools.launch import run_ranks
from helpers import assert_close_dicts, batches, mlp, params, shard

CAPS = dict(bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)  # several buckets, odd sizes: padding
STEPS, POISONED = 5, 1  # in step POISONED one element of rank 0's gradient is inf


def poison(module: nn.Module, which: int):
    """Make one element of one parameter's local gradient inf: after the reduction it is in one rank's shard."""
    param = list(module.parameters())[which]

    def hook(grad):
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad
    return param.register_hook(hook)


def scaled_training(rank, world_size, which, clip):
    ours = gradsync.ShardedDataParallel(mlp(seed=rank, width=33), **CAPS)  # ranks start apart: rank 0 wins
    theirs = nn.parallel.DistributedDataParallel(mlp(seed=rank, width=33))
    runs = [(ours, gradsync.ShardedOptimizer(ours, torch.optim.AdamW, lr=0.01), gradsync.ShardedGradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)),
            (theirs, torch.optim.AdamW(theirs.parameters(), lr=0.01), torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2))]
    scales, seen_here = {id(r[0]): [] for r in runs}, None
    for step, (x, y) in enumerate(batches(STEPS, world_size)):
        for net, opt, scaler in runs:
            handle = poison(net.module, which) if step == POISONED and rank == 0 else None
            scaler.scale(F.mse_loss(net(shard(x, rank, world_size)), shard(y, rank, world_size))).backward()
            if handle is not None:
                handle.remove()
            if step == POISONED and net is ours:  # the inf is in one rank's shard only: each rank's own look differs
                seen_here = not all(bool(torch.isfinite(g).all()) for g in shard_grads(opt))
            if clip:  # the usual AMP recipe: unscale, clip the true gradient, then step
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            scales[id(net)].append(scaler.get_scale())
    return params(ours.module), params(theirs.module), scales[id(ours)], scales[id(theirs)], seen_here


@pytest.mark.parametrize("clip", [False, True], ids=["step", "unscale_clip_step"])
@pytest.mark.parametrize("which", [0, -1], ids=["first_param", "last_param"])
def test_every_rank_skips_the_step_an_inf_in_one_shard_spoils(which, clip):
    results = run_ranks(scaled_training, 2, which, clip)
    assert sorted(r[4] for r in results) == [False, True]  # the inf was in exactly one rank's shard
    for ours, theirs, our_scales, their_scales, _ in results:
        assert our_scales == their_scales  # the poisoned step was skipped (the scale backed off) on every rank
        assert our_scales[POISONED] == our_scales[POISONED - 1] / 2
        assert_close_dicts(ours, theirs)


def plain_scaler(rank, world_size):
    model = gradsync.ShardedDataParallel(mlp(seed=0), **CAPS)
    opt = gradsync.ShardedOptimizer(model, torch.optim.AdamW, lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    x, y = batches(1, world_size)[0]
    scaler.scale(F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size))).backward()
    scaler.step(opt)


def test_torchs_own_scaler_on_sharded_gradients_fails_on_every_rank_before_any_step():
    """It must never find an inf on one rank and step on the others: it raises on each rank alike."""
    errors = run_ranks(plain_scaler, 2, return_errors=True)
    assert all("No inf checks were recorded" in str(e) for e in errors), errors


def test_with_any_other_optimizer_it_is_torchs_scaler():
    runs = []
    for scaler_class in (gradsync.ShardedGradScaler, torch.amp.GradScaler):
        net = mlp(seed=0)
        opt, scaler = torch.optim.SGD(net.parameters(), lr=0.1), scaler_class("cpu", init_scale=2.0 ** 10)
        for step, (x, y) in enumerate(batches(3, 1)):
            handle = poison(net, 0) if step == 1 else None
            scaler.scale(F.mse_loss(net(x), y)).backward()
            if handle is not None:
                handle.remove()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        runs.append((params(net), scaler.get_scale()))
    assert runs[0][1] == runs[1][1] == 2.0 ** 9
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0].values(), runs[1][0].values()))


def mixed_scales(rank, world_size):
    ours = gradsync.ShardedDataParallel(mlp(seed=0, width=33), **CAPS)
    theirs = nn.parallel.DistributedDataParallel(mlp(seed=0, width=33))
    opt, their_opt = gradsync.ShardedOptimizer(ours, torch.optim.AdamW, lr=0.01), torch.optim.AdamW(theirs.parameters(), lr=0.01)
    scaler = gradsync.ShardedGradScaler("cpu", init_scale=2.0 ** (10 + rank), growth_interval=2)  # as a fresh joiner's would
    their_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 9, growth_interval=2)  # every rank's after the skip
    start = params(ours.module)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, (x, y) in enumerate(batches(STEPS, world_size)):
            xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
            runs = [(ours, opt, scaler)] + ([(theirs, their_opt, their_scaler)] if step else [])
            for net, optimizer, s in runs:
                s.scale(F.mse_loss(net(xs), ys)).backward()
                s.step(optimizer)
                s.update()
                optimizer.zero_grad()
            if step == 0:
                skipped = all(torch.equal(a, b) for a, b in zip(params(ours.module).values(), start.values()))
                first = scaler.get_scale()
    warned = [str(w.message) for w in caught if "loss scales differed" in str(w.message)]
    return skipped, first, scaler.get_scale(), their_scaler.get_scale(), params(ours.module), params(theirs.module), warned


def test_ranks_whose_scales_differ_skip_that_step_and_take_the_smallest():
    """Scaled gradients of different scales were summed: no rank steps on them, and from then on they agree."""
    for skipped, first, last, their_last, ours, theirs, warned in run_ranks(mixed_scales, 2):
        assert skipped and first == 2.0 ** 9 and last == their_last  # the smallest, backed off, on every rank
        assert len(warned) == 1 and "gradsync.elastic.register('scaler', scaler)" in warned[0]
        assert_close_dicts(ours, theirs)
