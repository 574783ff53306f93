"""gradsync.audit: every rank computes the gradient of the same micro-batch; a rank whose arithmetic goes wrong
is named on every rank, and training with audits is bit-identical to training without (audit.py)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradsync
from helpers import run_ranks


def net() -> nn.Module:
    """Dropout (random numbers) and BatchNorm (buffers a forward updates): what an audit must put back."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 4),
                         nn.Linear(4, 4))


def loss_fn(module, batch):
    x, y = batch
    return F.mse_loss(module(x), y)


def corrupt_on(rank, culprit, module, armed):
    """On ``culprit``, while ``armed[0]``: one flipped bit in an activation, as a faulty core would make."""
    if rank != culprit:
        return
    def flip(mod, inputs, out):
        if armed[0]:
            out = out.clone()
            out.view(-1).view(torch.int32)[3] ^= 1 << 20
            return out
    module[0].register_forward_hook(flip)


def train(rank, world_size, steps, audit_every=0, culprit=None, sharded=False, views=False):
    """SGD with momentum (``sharded``: True, or "prefetch": the parameters' all-gathers still in flight at the
    audit); an audit after each ``audit_every``-th step (its micro-batch: rank 0's). Return
    (steps done, audits passed, error type, message, parameters, buffers, the next random number)."""
    wrap = gradsync.ShardedDataParallel if sharded else gradsync.DistributedDataParallel
    model = wrap(net(), **({} if sharded else {"gradient_as_bucket_view": views}))
    opt = (gradsync.ShardedOptimizer(model, torch.optim.SGD, lr=0.05, momentum=0.9, prefetch=sharded == "prefetch")
           if sharded
           else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    armed = [False]
    corrupt_on(rank, culprit, model.module, armed)
    g, audit_data = torch.Generator().manual_seed(rank), torch.Generator().manual_seed(50 + rank)
    done = passed = 0
    torch.manual_seed(100 + rank)
    try:
        for step in range(steps):
            x = torch.randn(6, 8, generator=g)
            F.mse_loss(model(x), x[:, :4]).backward()
            opt.step()
            opt.zero_grad()
            done = step + 1
            if audit_every and done % audit_every == 0:
                armed[0] = step >= 2
                batch = torch.randn(5, 8, generator=audit_data), torch.randn(5, 4, generator=audit_data)
                report = gradsync.audit(model, loss_fn, batch)
                armed[0] = False
                assert report.complete and report.compared == len(list(model.parameters()))
                passed += 1
    except gradsync.SyncError as exc:
        return done, passed, type(exc).__name__, str(exc), None, None, None
    return (done, passed, None, None, {n: p.detach().clone() for n, p in model.module.named_parameters()},
            {n: b.clone() for n, b in model.module.named_buffers()}, torch.rand(1))


@pytest.mark.parametrize("sharded,views", [(False, False), (False, True), (True, False), ("prefetch", False)])
def test_training_with_audits_is_bit_identical_to_training_without(sharded, views):
    audited = run_ranks(train, 3, 6, 1, None, sharded, views)
    plain = run_ranks(train, 3, 6, 0, None, sharded, views)
    for (done, passed, error, _, params, buffers, rand), (_, _, _, _, ref, ref_buffers, ref_rand) in zip(audited, plain):
        assert (done, passed, error) == (6, 6, None)
        assert all(torch.equal(params[n], ref[n]) for n in ref)  # the audits left no gradient behind
        assert all(torch.equal(buffers[n], ref_buffers[n]) for n in ref_buffers)  # BatchNorm's running stats put back
        assert torch.equal(rand, ref_rand)  # and the random state


def test_a_rank_whose_arithmetic_goes_wrong_is_named_on_every_rank():
    results = run_ranks(train, 3, 6, 1, 2)
    for done, passed, error, message, *_ in results:
        assert error == "ReplicaMismatchError" and (done, passed) == (3, 2), (done, passed, message)
        assert "rank(s) [2] disagree with the majority of ranks [0, 1, 2]" in message, message
        assert "computed different gradients from the same micro-batch and parameters" in message
        assert "'0.weight'" in message  # the first layer's output was corrupted: every gradient below it differs
    assert len({r[:4] for r in results}) == 1  # the same error on every rank


def test_with_two_ranks_both_are_named():
    for done, passed, error, message, *_ in run_ranks(train, 2, 4, 1, 0):
        assert error == "ReplicaMismatchError" and done == 3, message
        assert "ranks [0, 1] disagree and no majority can tell which is right" in message


def test_parameters_that_already_differ_are_named_as_such():
    def fn(rank, world_size):
        model = gradsync.DistributedDataParallel(net())
        if rank == 1:
            with torch.no_grad():
                model.module[4].bias[0] += 1.0
        batch = (torch.randn(5, 8), torch.randn(5, 4)) if rank == 0 else None
        with pytest.raises(gradsync.ReplicaMismatchError, match=r"rank\(s\) \[1\] disagree .*hold different parameters "
                                                                r"\('4.bias'\)"):
            gradsync.audit(model, loss_fn, batch)
    run_ranks(fn, 3)


def test_an_audit_on_one_rank_and_a_backward_on_the_other_raise_on_both():
    def fn(rank, world_size):
        model = gradsync.DistributedDataParallel(nn.Linear(8, 4), timeout=60)
        with pytest.raises(gradsync.SyncError, match=r"out of step: .*is in gradsync.audit"):
            if rank == 0:
                gradsync.audit(model, loss_fn, (torch.randn(5, 8), torch.randn(5, 4)))
            else:
                model(torch.randn(5, 8)).sum().backward()
    run_ranks(fn, 2)


def test_bad_input_gets_a_clear_error():
    def fn(rank, world_size):
        model = gradsync.DistributedDataParallel(nn.Linear(8, 4))
        with pytest.raises(TypeError, match="expected a gradsync DistributedDataParallel"):
            gradsync.audit(nn.Linear(8, 4), loss_fn, None)
        with pytest.raises(TypeError, match="must return a scalar tensor that requires grad"):
            gradsync.audit(model, lambda module, batch: module(batch), torch.randn(5, 8))
        with model.join(), pytest.raises(RuntimeError, match="inside model.join"):  # a joined rank would not take part
            gradsync.audit(model, loss_fn, None)
        assert gradsync.audit(model, loss_fn, (torch.randn(5, 8), torch.randn(5, 4))).compared == 2  # still in step
    run_ranks(fn, 2)
