"""Uneven inputs: ``with model.join():`` when ranks have different numbers of batches."""
import pytest
import torch
import torch.nn.functional as F

import gradsync
from gradsync.tools.launch import run_ranks
from helpers import TIMEOUT, Normed, assert_close_dicts, batches, faults, mlp, outcome, params, shard, shard_backward

COUNTS = {"2_more": [3, 5], "one_rank_empty": [0, 2], "three_ranks": [4, 1, 2]}


def uneven(rank, world_size, counts, accumulate, hook):
    model = gradsync.DDP(mlp(seed=rank), bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005,
                         timeout=TIMEOUT)
    if hook:
        model.register_comm_hook(None, gradsync.allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = batches(max(counts), world_size)[:counts[rank]]
    with model.join():
        for x, y in data:
            xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
            if accumulate:  # two micro-batches per step, the first without communication
                with model.no_sync():
                    (F.mse_loss(model(xs[:3]), ys[:3]) / 2).backward()
                (F.mse_loss(model(xs[3:]), ys[3:]) / 2).backward()
            else:
                F.mse_loss(model(xs), ys).backward()
            opt.step()
            opt.zero_grad()
    return params(model.module)


def reference(world_size, counts, accumulate):
    """One process: each step averages the active ranks' gradients over the full world size."""
    model = mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for t, (x, y) in enumerate(batches(max(counts), world_size)):
        active = [r for r in range(world_size) if counts[r] > t]
        loss = 0
        for r in active:
            xs, ys = shard(x, r, world_size), shard(y, r, world_size)
            if accumulate:
                loss = loss + (F.mse_loss(model(xs[:3]), ys[:3]) + F.mse_loss(model(xs[3:]), ys[3:])) / 2
            else:
                loss = loss + F.mse_loss(model(xs), ys)
        (loss / world_size).backward()
        opt.step()
        opt.zero_grad()
    return params(model)


@pytest.mark.parametrize("counts", list(COUNTS))
@pytest.mark.parametrize("accumulate", [False, True], ids=["sync_each", "no_sync_window"])
def test_join_matches_the_reference(counts, accumulate):
    c = COUNTS[counts]
    results = run_ranks(uneven, len(c), c, accumulate, False, timeout=40)
    want = reference(len(c), c, accumulate)
    for got in results:
        assert_close_dicts(got, want, atol=1e-5)
        for name in got:  # every rank ends with the same parameters, bit for bit
            assert torch.equal(got[name], results[0][name]), name


def test_join_with_a_comm_hook():
    results = run_ranks(uneven, 2, [3, 5], False, True, timeout=40)
    assert_close_dicts(results[0], reference(2, [3, 5], False))
    assert_close_dicts(results[1], reference(2, [3, 5], False))


def uneven_with_buffers(rank, world_size):
    model = gradsync.DDP(Normed(), timeout=TIMEOUT)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.join():
        for _ in range(2 + 2 * rank):
            model(torch.randn(4, 8) + rank).sum().backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():  # a forward without gradients is shadowed too (buffers only)
                model(torch.randn(4, 8))
    return {n: t.clone() for n, t in model.module.state_dict().items()}


def test_join_with_buffers_ends_with_identical_state():
    a, b = run_ranks(uneven_with_buffers, 2, timeout=40)
    assert int(a["bn.num_batches_tracked"]) == 8  # rank 1: 4 steps of 2 forwards; rank 0 alone would have 4
    for name in a:
        assert torch.equal(a[name], b[name]), name


def join_disagree(rank, world_size):
    model = gradsync.DDP(mlp(), timeout=TIMEOUT)
    x, y = batches(1, world_size)[0]

    def body():
        with model.join():
            model.require_backward_grad_sync = rank == 0
            shard_backward(model, rank, world_size, x, y)
    return outcome(body)


def test_join_detects_no_sync_disagreement_at_the_forward():
    for kind, message, seconds in faults(join_disagree):
        assert kind == "SyncError" and "1 of 2 active ranks will sync" in message, message
        assert seconds < 1


def accumulated(rank, world_size, windows, steps, divide):
    """The accumulator's windows inside join(): rank r runs ``windows[r]`` windows of ``steps`` micro-batches."""
    model = gradsync.DDP(mlp(seed=rank), timeout=TIMEOUT)
    acc = gradsync.GradientAccumulator(model, steps)
    opt = acc.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    data = batches(max(windows) * steps, world_size)[:windows[rank] * steps]
    with model.join(divide_by_initial_world_size=divide):
        for x, y in data:
            with acc.accumulate():
                acc.backward(F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)))
                opt.step()
                opt.zero_grad()
    return params(model.module)


def mean_over_what_ran(world_size, windows, steps):
    model = mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batches(max(windows) * steps, world_size)
    for w in range(max(windows)):
        active = [r for r in range(world_size) if windows[r] > w]
        losses = [F.mse_loss(model(shard(x, r, world_size)), shard(y, r, world_size))
                  for x, y in data[w * steps:(w + 1) * steps] for r in active]
        (sum(losses) / len(losses)).backward()
        opt.step()
        opt.zero_grad()
    return params(model)


@pytest.mark.parametrize("divide", [True, False], ids=["by_world_size", "by_active_ranks"])
def test_accumulator_windows_inside_join_are_the_mean_over_what_ran(divide):
    """divide_by_initial_world_size=False divided the reduction by the active ranks and the accumulator's rescale
    by the world size again: the windows one rank ran alone were twice the mean."""
    windows, steps = [2, 3], 2
    want = mean_over_what_ran(2, windows, steps)
    for got in run_ranks(accumulated, 2, windows, steps, divide, timeout=60):
        assert_close_dicts(got, want, atol=1e-6)


def sync_each_batch_in_join(rank, world_size):
    model = gradsync.DDP(mlp(seed=rank), timeout=TIMEOUT)
    acc = gradsync.GradientAccumulator(model, 2, sync_each_batch=True)
    x, y = batches(1, world_size)[0]
    with pytest.raises(NotImplementedError, match="sync_each_batch=True inside model.join"):
        with model.join():
            with acc.accumulate():
                acc.backward(F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)))
    with acc.accumulate():  # outside the join it runs
        acc.backward(F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)))
    with model.join(enable=False):  # and inside a disabled one (torch's Join calls the join hook all the same)
        for _ in range(2):
            with acc.accumulate():
                acc.backward(F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)))
    return True


def test_sync_each_batch_inside_join_is_refused_on_every_rank():
    """Each synced micro-step reduced the window's sum so far again, a joined rank adding zeros for it: a window's
    micro-batches weighed 1/8, 1/4, 1/2, 1 of the mean."""
    assert run_ranks(sync_each_batch_in_join, 2, timeout=60) == [True, True]
