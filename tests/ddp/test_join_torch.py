"""join() with torch's keywords and the Joinable protocol (torch.distributed.algorithms.Join)."""
import pytest
import torch
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable
from torch.distributed.optim import ZeroRedundancyOptimizer

import gradsync
from gradsync.tools.launch import run_ranks
from helpers import assert_close_dicts, mlp, params

TorchDDP = nn.parallel.DistributedDataParallel


def grad_division(rank, world_size, cls):
    """torch's test_ddp_grad_div_uneven_inputs, on CPU."""
    torch.manual_seed(0)
    net = cls(nn.Linear(5, 5, bias=False), bucket_cap_mb=1)
    inp = torch.ones(1, 5) * 50
    n_iters = 3 + 2 * (rank > 0)
    seen = {}
    for divide in (False, True):
        seen[divide] = []
        with net.join(divide_by_initial_world_size=divide):
            for _ in range(n_iters):
                net(inp).sum().backward()
                seen[divide].append(next(net.parameters()).grad.clone())
                net.zero_grad()
    return seen, isinstance(net, Joinable), net._authoritative_rank


def test_divide_by_initial_world_size_like_torch():
    ours = run_ranks(grad_division, 2, gradsync.DDP)
    theirs = run_ranks(grad_division, 2, TorchDDP)
    for rank in range(2):
        seen, joinable, authoritative = ours[rank]
        assert joinable and authoritative == 1  # the highest of the last ranks to join, as torch
        for divide in (False, True):
            for i, grad in enumerate(seen[divide]):
                active = 1 if i >= 3 else 2
                expected = 50.0 if not divide else 50.0 * active / 2
                assert torch.equal(grad, torch.full((5, 5), expected)), (rank, divide, i)
                assert torch.equal(grad, theirs[rank][0][divide][i])


def early_termination(rank, world_size, cls):
    torch.manual_seed(0)
    net = cls(mlp(seed=0))
    steps = 0
    with pytest.raises(RuntimeError) as info:
        with net.join(throw_on_early_termination=True):
            for _ in range(2 + 2 * rank):
                net(torch.ones(3, 8)).sum().backward()
                steps += 1
    net.zero_grad()
    net(torch.ones(3, 8) * (rank + 1)).sum().backward()  # the model trains on afterwards
    return str(info.value), steps, params(net.module), {n: p.grad for n, p in net.module.named_parameters()}


def test_throw_on_early_termination_raises_on_every_rank():
    for cls in (gradsync.DDP, TorchDDP):
        (m0, s0, p0, g0), (m1, s1, p1, g1) = run_ranks(early_termination, 2, cls, timeout=60)
        assert "Rank 0 exhausted all inputs" in m0 and "Detected at least one rank" in m1, cls
        assert s0 == s1 == 2
        assert_close_dicts(g0, g1)


def with_zero(rank, world_size, cls):
    model = cls(mlp(seed=rank), bucket_cap_mb=0.001)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    g = torch.Generator().manual_seed(rank)
    with Join([model, opt]):
        for _ in range(2 + 3 * rank):
            model(torch.randn(4, 8, generator=g)).sum().backward()
            opt.step()
            opt.zero_grad()
    return params(model.module)


def test_join_with_torchs_zero_redundancy_optimizer_matches_torch_ddp():
    ours = run_ranks(with_zero, 3, gradsync.DDP, timeout=90)
    theirs = run_ranks(with_zero, 3, TorchDDP, timeout=90)
    for rank in range(3):
        assert_close_dicts(ours[rank], theirs[rank], atol=1e-6)
        assert_close_dicts(ours[rank], ours[0], atol=0, rtol=0)


def join_disabled(rank, world_size):
    net = gradsync.DDP(mlp(seed=0))
    with net.join(enable=False):
        net(torch.ones(3, 8)).sum().backward()
    with net.join():  # a second join after the first
        for _ in range(1 + rank):
            net(torch.ones(3, 8)).sum().backward()
    return params(net.module)


def test_join_can_be_disabled_and_entered_again():
    a, b = run_ranks(join_disabled, 2, timeout=60)
    assert_close_dicts(a, b, atol=0, rtol=0)


def batch_norm_uneven(rank, world_size):
    """BatchNorm's running statistics through a join: rank 0 runs 3 batches, the others 5; both wrappers."""
    out = []
    for cls in (TorchDDP, gradsync.DDP):
        torch.manual_seed(0)
        net = cls(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        seen = []
        with net.join():
            for _ in range(3 if rank == 0 else 5):
                net(torch.randn(6, 4, generator=g)).sum().backward()
                opt.step()
                opt.zero_grad()
                seen.append({n: b.clone() for n, b in net.module.named_buffers()})
        out.append((seen, params(net.module), {n: b.clone() for n, b in net.module.named_buffers()}))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_buffers_through_a_join_come_from_the_highest_active_rank_as_torchs(world_size):
    # rank 0 may have joined with stale buffers: every forward broadcasts from the highest active rank
    for theirs, ours in run_ranks(batch_norm_uneven, world_size):
        for a, b in zip(theirs[0], ours[0]):
            assert_close_dicts(a, b, atol=0, rtol=0)
        assert_close_dicts(theirs[1], ours[1])
        assert_close_dicts(theirs[2], ours[2], atol=0, rtol=0)
