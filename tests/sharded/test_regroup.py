"""Mirrored shards (``sharded/regroup.py``): each rank also steps the next rank's shard, bit for bit as its owner.

The drills that kill a replica and re-shard are in ``tests/elastic/test_elastic.py``; here, in 3 gloo ranks,
the mirror itself: the same gradient, AdamW state and master as the owner's after every window (a scheduler
and clipping included), and the same training as without mirroring.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import gradsync
from gradsync.sharded.regroup import chosen_shards
from gradsync.tools.launch import run_ranks
from helpers import mlp

WINDOWS, K = 4, 2


def train(rank, world_size, mirrored, dtype=torch.float32):
    torch.manual_seed(0)
    model = gradsync.ShardedDataParallel(mlp(seed=1, width=33, depth=4, dtype=dtype), bucket_cap_mb=0.002,
                                         first_bucket_cap_mb=0.001)
    if mirrored:
        model.reducer.store.mirror_shards()
    optimizer = gradsync.ShardedOptimizer(model, torch.optim.AdamW, lr=0.01, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)  # the mirror must follow it
    acc = gradsync.GradientAccumulator(model, steps=K)
    g = torch.Generator().manual_seed(10 + rank)
    agree = []
    for _ in range(WINDOWS * K):
        with acc.accumulate():
            x, y = torch.randn(4, 8, generator=g).to(dtype), torch.randn(4, 4, generator=g).to(dtype)
            acc.backward(F.mse_loss(model(x), y))
        if acc.is_boundary:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if mirrored:
                agree.append(mirror_agrees(model, optimizer, rank, world_size))
    return [p.detach().clone() for p in model.parameters()], agree


def mirror_agrees(model, optimizer, rank, world_size):
    """Rank r's mirror against rank r + 1's own shard: the AdamW state and the master, bit for bit."""
    mine = {"state": optimizer.pieces_state(mirror=True), "masters": optimizer.mirror.masters,
            "own_state": optimizer.pieces_state(), "own_masters": optimizer.own.masters}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine)
    theirs = everyone[(rank + 1) % world_size]
    same_state = [(j, off, n) for j, off, n, _ in mine["state"]] == [(j, off, n) for j, off, n, _ in theirs["own_state"]]
    same_values = all(torch.equal(a[3][k], b[3][k]) for a, b in zip(mine["state"], theirs["own_state"]) for k in a[3])
    same_masters = all(torch.equal(a, b) for a, b in zip(mine["masters"], theirs["own_masters"]))
    return same_state and same_values and same_masters and len(mine["state"]) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_mirror_steps_bit_for_bit_as_its_owner(dtype):
    """bf16: the copies of a bf16 bucket are summed in the float32 shard, into this rank's half of the pair."""
    mirrored = run_ranks(train, 3, True, dtype, timeout=90)
    plain = run_ranks(train, 3, False, dtype, timeout=90)
    for params, agree in mirrored:
        assert agree == [True] * WINDOWS
        for got, want in zip(params, plain[0][0]):  # on CPU the same all-to-all and fold: the same bits
            assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(mirrored[0][0], mirrored[1][0]))


def test_two_neighbours_that_leave_together_take_a_shard_with_them():
    """Rank 0 of 3 holds shards 0 and 1 (its mirror): with ranks 1 and 2 gone, shard 2 is nowhere."""
    survivor = {"owner": 0, "world": 3, "shards": {0: "own", 1: "mirror"}}
    assert chosen_shards([survivor, {"owner": 2, "world": 3, "shards": {2: "own", 0: "mirror"}}]) == ["own", "mirror", "own"]
    with pytest.raises(RuntimeError, match="held only by replicas that left together.*checkpoint"):
        chosen_shards([survivor])
