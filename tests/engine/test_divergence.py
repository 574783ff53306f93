"""Diverging, leaving and dead ranks with default arguments: every survivor raises within 90 s.

No ``timeout=`` anywhere: the process group keeps torch's 30-minute default and gradsync waits
as long. Divergence must be *detected* (the phase headers of ``engine/header.py`` pair whatever
each rank is doing), a departed rank noticed through its closed connections, and a rank that is
only slow must keep working.
"""
import os
import signal
import time

import pytest
import torch

import gradsync
from helpers import Normed, batches, mlp, outcome, reference, shard, shard_backward
from gradsync.tools.launch import RankError, run_ranks

BOUND = 90  # seconds: the bound for every survivor's error
ODD = 1  # the rank that misbehaves


def loop(rank, world_size, how, buffers):
    model = gradsync.DDP(Normed() if buffers else mlp())  # default arguments
    steps = 4 - (how == "leave_early" and rank == ODD)
    data = batches(steps, world_size)
    odd = rank == ODD

    def train():
        for i, (x, y) in enumerate(data):
            if odd and i == 1 and how == "killed":
                os.kill(os.getpid(), signal.SIGKILL)
            micro = 1 if odd and i == 1 and how == "skip_forward" else 2  # a dropped micro-step
            with model.no_sync():
                for _ in range(micro - 1):
                    shard_backward(model, rank, world_size, x, y)
            if odd and i == 1 and how == "skip_backward":
                model(shard(x, rank, world_size))  # e.g. "if not loss.isfinite(): continue"
            elif odd and i == 1 and how == "no_sync":
                with model.no_sync():
                    shard_backward(model, rank, world_size, x, y)
            else:
                shard_backward(model, rank, world_size, x, y)
    return outcome(train)


CASES = ["skip_backward", "skip_forward", "no_sync", "leave_early", "killed"]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("buffers", [False, True], ids=["no_buffers", "buffers"])
@pytest.mark.parametrize("how", CASES)
def test_every_survivor_raises_within_the_bound(how, buffers, world_size):
    results = run_ranks(loop, world_size, how, buffers, timeout=BOUND + 60, pg_timeout=None,
                        return_errors=True)
    for rank, result in enumerate(results):
        if rank == ODD and how == "killed":
            assert isinstance(result, RankError) and ("died" in str(result) or "without a result" in str(result))
            continue
        if rank == ODD and how == "leave_early":
            assert result[0] == "ok", result  # it left its loop and exited
            continue
        assert not isinstance(result, RankError), result  # a rank killed by the harness: a hang
        kind, message, seconds = result
        assert kind == "SyncError", (rank, kind, message)
        assert seconds < BOUND, (rank, seconds)
        if how in ("leave_early", "killed"):  # noticed through the departed rank's closed sockets
            assert "another rank died" in message, message
        else:  # detected: every rank names what each rank was doing
            assert "the ranks are out of step" in message, message
            assert all(f"rank {r} " in message for r in range(world_size)), message
        print(f"\n[measured] {how}/{'buffers' if buffers else 'no_buffers'}/{world_size} ranks, "
              f"rank {rank}: {seconds:.2f}s")


def paused(rank, world_size, buffers, pause):
    model = gradsync.DDP(Normed() if buffers else mlp())
    history = []
    for i, (x, y) in enumerate(batches(3, world_size)):
        if rank == 0 and i == 1:
            time.sleep(pause)  # rank 0 writes a checkpoint; the others wait in the next header
        model.zero_grad()
        shard_backward(model, rank, world_size, x, y)
        history.append({n: p.grad.clone() for n, p in model.module.named_parameters()})
    return history


def check_pause(buffers, pause):
    results = run_ranks(paused, 2, buffers, pause, timeout=pause + 120, pg_timeout=None)
    torch.testing.assert_close(results[0], results[1])
    if not buffers:  # BatchNorm's batch statistics are per shard: only the no-buffer model has one
        torch.testing.assert_close(results[0], reference(mlp(), batches(3, 2)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("buffers", [False, True], ids=["no_buffers", "buffers"])
def test_a_slow_rank_is_not_an_error(buffers):
    check_pause(buffers, pause=5)


@pytest.mark.slow
def test_a_three_minute_pause_is_not_an_error():
    """Run with ``make test-slow``: rank 0 pauses 3 minutes between steps, default arguments."""
    check_pause(True, pause=180)


def item_windows(rank, world_size, buffers):
    """``GradientAccumulator`` in num_items mode, rank ODD planning longer windows than the others."""
    import torch.nn.functional as F

    model = gradsync.DDP(Normed() if buffers else mlp())
    acc = gradsync.GradientAccumulator(model, steps=3 if rank == ODD else 2)

    def train():
        for x, y in batches(6, world_size):
            with acc.accumulate():
                xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
                acc.backward(F.mse_loss(model(xs), ys, reduction="sum"), num_items=len(xs))
    return outcome(train)


@pytest.mark.parametrize("buffers", [False, True], ids=["no_buffers", "buffers"])
def test_num_items_windows_that_disagree_are_detected(buffers):
    """The window's item count rides in the backward's phase header: no collective of its own that
    a rank closing its window could pair with another rank's forward broadcast or header."""
    results = run_ranks(item_windows, 2, buffers, timeout=BOUND + 60, pg_timeout=None, return_errors=True)
    for rank, result in enumerate(results):
        assert not isinstance(result, RankError), result  # a rank killed by the harness: a hang
        kind, message, seconds = result
        assert kind == "SyncError" and "the ranks are out of step" in message, (rank, kind, message)
        assert seconds < BOUND, (rank, seconds)
        print(f"\n[measured] num_items windows/{'buffers' if buffers else 'no_buffers'}, rank {rank}: {seconds:.2f}s")


def crossed_models(rank, world_size):
    """Two models in their own groups; one backward runs through A then B on rank 0, B then A on rank 1."""
    groups = [torch.distributed.new_group([0, 1]) for _ in range(2)]
    a, b = (gradsync.DDP(mlp(seed=s), process_group=g, find_unused_parameters=True, timeout=3)
            for s, g in zip((0, 1), groups))
    first, second = (a, b) if rank == 0 else (b, a)

    def run():
        x = torch.randn(4, 8)
        (second(torch.cat([first(x), x[:, 4:]], dim=1)).sum()).backward()
    return outcome(run)


def test_a_backward_through_two_models_in_another_order_per_rank_names_that_cause():
    """Each rank waits inside the first model's backward for the other rank's header: the timeout's message listed
    only a dead or diverging rank."""
    for kind, message, _ in run_ranks(crossed_models, 2, timeout=BOUND):
        assert kind == "SyncError" and "several wrapped models in a different order" in message, message
