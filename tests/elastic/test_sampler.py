"""ElasticSampler without a membership change: uneven deals with torch's DDP and gradsync's, deterministic blocks,
sync_each_batch, checkpoints inside a window and argument checks (real gloo ranks, forked by run_ranks)."""
import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradsync
from gradsync.elastic import ElasticSampler
from gradsync.elastic.data import deal
from gradsync.tools.launch import run_ranks

X = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
Y = torch.randn(32, 1, generator=torch.Generator().manual_seed(1))


def net(buffers: bool = False) -> nn.Module:
    torch.manual_seed(0)
    if buffers:
        return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))


def wrap(kind: str, module: nn.Module) -> nn.Module:
    if kind == "torch":
        return nn.parallel.DistributedDataParallel(module)
    if kind == "replaced":  # Accelerate's and Lightning's path: torch's name builds gradsync's wrapper
        with gradsync.replace_torch_ddp():
            return nn.parallel.DistributedDataParallel(module)
    return gradsync.DistributedDataParallel(module, deterministic=kind == "deterministic")


def window_grads(rank, world_size, kind, global_batch, items=False, each=False, buffers=False):
    """One window of ``global_batch`` samples in micro-batches of 4: this rank's gradients after it."""
    model = wrap(kind, net(buffers))
    acc = gradsync.GradientAccumulator(model, steps=1, sync_each_batch=each)
    sampler = ElasticSampler(global_batch, micro_batch=4, global_batch=global_batch)
    ran = []
    for idx in sampler.iterate(acc):
        ran.append(list(idx))
        with acc.accumulate():
            if items:
                acc.backward(F.mse_loss(model(X[idx]), Y[idx], reduction="sum"), num_items=len(idx))
            else:
                acc.backward(F.mse_loss(model(X[idx]), Y[idx]))
    return ran, [p.grad.detach().clone() for p in model.module.parameters()]


def one_process(global_batch: int) -> list[torch.Tensor]:
    """The mean loss over every sample of the window (each micro-batch holds the same number of samples)."""
    ref = net()
    F.mse_loss(ref(X[:global_batch]), Y[:global_batch]).backward()
    return [p.grad for p in ref.parameters()]


@pytest.mark.parametrize("items", [False, True], ids=["mean", "num_items"])
@pytest.mark.parametrize("kind", ["torch", "replaced"])
def test_torch_ddp_with_an_uneven_deal_gets_the_mean_over_the_window(items, kind):
    """3 micro-batches dealt 2 and 1 under torch's own DDP (no phase header): each rank's gradient is the
    mean over all 3, as on one process (the accumulator's fallback used to assume every rank ran 2 or 1). Built
    through replace_torch_ddp() it is gradsync's, which has no will_sync_module_buffers: the check raised."""
    results = run_ranks(window_grads, 2, kind, 12, items, timeout=60)
    assert [len(ran) for ran, _ in results] == [2, 1]
    for _, got in results:
        for g, want in zip(got, one_process(12)):
            torch.testing.assert_close(g, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", ["torch", "gradsync"])
def test_buffers_broadcast_at_every_forward_with_an_uneven_deal_are_refused_on_every_rank(kind):
    """A forward that broadcasts buffers is a collective: ranks running 2 and 1 forwards would pair them
    with different collectives (torch's DDP silently, gradsync's on one rank only). Every rank refuses."""
    results = run_ranks(window_grads, 2, kind, 12, False, False, True, timeout=60, return_errors=True)
    for r in results:
        assert isinstance(r, Exception), r
        assert "gradsync: " in str(r) and "broadcast_buffers=False" in str(r), str(r)[-2000:]
        assert "out of step" not in str(r) and "closed" not in str(r), str(r)[-2000:]


def test_deterministic_blocks_differ_by_at_most_one_and_keep_the_order():
    for n, members in [(4, [0, 1, 2]), (6, [0, 1, 2, 3]), (7, [3, 5, 9]), (8, [0, 1]), (5, [0, 1])]:
        chunk = list(range(4 * n))
        dealt = deal(chunk, 4, members, blocks=True)
        sizes = [len(dealt[m]) for m in members]
        k, r = divmod(n, len(members))
        assert sizes == [k + 1] * r + [k] * (len(members) - r), (n, members, sizes)
        assert [i for m in members for mb in dealt[m] for i in mb] == chunk  # contiguous, in member order


def test_deterministic_with_uneven_blocks_trains_the_same_bits_on_every_rank():
    """4 micro-batches on 3 deterministic ranks: blocks of 2, 1 and 1 (ceil blocks gave the third rank none and
    it crashed). Every rank holds the same bits, the mean over all 4 micro-batches to rounding."""
    results = run_ranks(window_grads, 3, "deterministic", 16, timeout=60)
    assert [len(ran) for ran, _ in results] == [2, 1, 1]
    for _, got in results:
        assert all(torch.equal(g, first) for g, first in zip(got, results[0][1]))
        for g, want in zip(got, one_process(16)):
            torch.testing.assert_close(g, want, atol=1e-6, rtol=1e-5)


def test_deterministic_with_equal_blocks_is_still_the_one_process_tree():
    """8 micro-batches on 2 deterministic ranks (blocks of 4): the same bits as deterministic=True on one rank."""
    two = run_ranks(window_grads, 2, "deterministic", 32, timeout=60)
    (one,) = run_ranks(window_grads, 1, "deterministic", 32, timeout=60)
    assert [len(ran) for ran, _ in two] == [4, 4] and two[0][0] + two[1][0] == one[0]
    for _, got in two:
        assert all(torch.equal(g, ref) for g, ref in zip(got, one[1]))


def test_sync_each_batch_with_an_uneven_deal_is_refused_on_every_rank():
    results = run_ranks(window_grads, 2, "gradsync", 12, False, True, timeout=60, return_errors=True)
    for r in results:
        assert isinstance(r, Exception), r
        assert "gradsync: " in str(r) and "sync_each_batch" in str(r) and "out of step" not in str(r), str(r)[-2000:]


def test_sync_each_batch_with_an_even_deal_is_the_mean_over_the_window():
    for _, got in run_ranks(window_grads, 2, "gradsync", 16, False, True, timeout=60):
        for g, want in zip(got, one_process(16)):
            torch.testing.assert_close(g, want, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------- checkpoints inside a window
def fresh(**kwargs):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    acc = gradsync.GradientAccumulator(model, steps=4)
    opt = acc.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    return model, acc, opt, ElasticSampler(32, micro_batch=2, seed=1, epochs=2, **kwargs)


def train(model, acc, opt, sampler, stop=None):
    """Train on the sampler's micro-batches; stop after ``stop`` of them: the micro-batches that ran."""
    got = []
    for idx in sampler.iterate(acc):
        got.append(list(idx))
        with acc.accumulate():
            acc.backward(F.mse_loss(model(X[torch.tensor(idx) % 16]), Y[torch.tensor(idx) % 16]))
        opt.step()
        opt.zero_grad()
        if len(got) == stop:
            break
    return got


@pytest.mark.parametrize("kwargs", [dict(steps=4), dict(global_batch=8)])
@pytest.mark.parametrize("stop", [6, 8, 1])
def test_a_state_dict_taken_inside_a_window_resumes_at_the_next_micro_batch(kwargs, stop):
    model, acc, opt, sampler = fresh(**kwargs)
    full = train(model, acc, opt, sampler)
    want = [p.detach().clone() for p in model.parameters()]
    model, acc, opt, sampler = fresh(**kwargs)
    first = train(model, acc, opt, sampler, stop=stop)
    saved = sampler.state_dict(), acc.state_dict(), [p.grad.clone() if p.grad is not None else None
                                                     for p in model.parameters()], model.state_dict()
    model, acc, opt, sampler = fresh(**kwargs)
    sampler.load_state_dict(saved[0])
    acc.load_state_dict(saved[1])
    model.load_state_dict(saved[3])
    for p, g in zip(model.parameters(), saved[2]):
        p.grad = g
    rest = train(model, acc, opt, sampler)
    assert first + rest == full
    for got, ref in zip(model.parameters(), want):
        torch.testing.assert_close(got.detach(), ref, atol=1e-6, rtol=1e-5)


def fresh_state(stop):
    model, acc, opt, sampler = fresh(steps=4)
    train(model, acc, opt, sampler, stop=stop)
    return sampler.state_dict()


def test_a_state_dict_taken_inside_a_window_needs_the_accumulators_state_too():
    model, acc, opt, sampler = fresh(steps=4)
    sampler.load_state_dict(fresh_state(6))
    with pytest.raises(ValueError, match="gradsync: .*accumulator"):
        next(sampler.iterate(acc))


def members_of_two(rank, world_size, state):
    model = gradsync.DistributedDataParallel(nn.Linear(4, 1))
    acc = gradsync.GradientAccumulator(model, steps=4)
    sampler = ElasticSampler(32, micro_batch=2, steps=4, seed=1)
    sampler.load_state_dict(state)
    with contextlib.suppress(StopIteration):
        next(sampler.iterate(acc))


def test_a_state_dict_taken_inside_a_window_is_refused_on_another_membership():
    """A window dealt to one member cannot be resumed on two: every rank refuses alike."""
    for r in run_ranks(members_of_two, 2, fresh_state(6), timeout=60, return_errors=True):
        assert isinstance(r, Exception) and "gradsync: " in str(r) and "members" in str(r), r


# ---------------------------------------------------------------- arguments
@pytest.mark.parametrize("n, kwargs, words", [
    (10, dict(micro_batch=2, steps=1.5), "steps"),
    (10, dict(micro_batch=2, steps=True), "steps"),
    (10, dict(micro_batch=2, global_batch=4.0), "global_batch"),
    (10, dict(micro_batch=2.5, steps=1), "micro_batch"),
    (10, dict(micro_batch=0, steps=1), "micro_batch"),
    (-5, dict(micro_batch=2, steps=1), "num_samples"),
    (10.0, dict(micro_batch=2, steps=1), "num_samples"),
    (10, dict(micro_batch=4, global_batch=0), "global_batch must be an integer >= 1"),
    (10, dict(micro_batch=4, global_batch=6), "multiple of micro_batch"),
    (10, dict(micro_batch=2, steps=1, epochs=0), "epochs"),
    (10, dict(micro_batch=2, steps=1, seed=0.5), "seed"),
    (10, dict(micro_batch=2, global_batch=12), "only 10 samples"),
])
def test_bad_arguments_are_refused_at_construction(n, kwargs, words):
    with pytest.raises(ValueError, match="gradsync: ") as err:
        ElasticSampler(n, **kwargs)
    assert words in str(err.value), str(err.value)


def test_a_dataset_smaller_than_one_window_is_refused_when_dealt():
    """With steps= the window's size follows the membership: 8 samples a window of one member, 6 in the data."""
    model = nn.Linear(4, 1)
    acc = gradsync.GradientAccumulator(model, steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="gradsync: .*only 6 samples"):
            list(ElasticSampler(6, micro_batch=4, steps=2).iterate(acc))


def test_numpy_style_integers_are_accepted():
    np = pytest.importorskip("numpy")
    sampler = ElasticSampler(np.int64(8), micro_batch=np.int64(2), global_batch=np.int64(4), seed=np.int64(3))
    acc = gradsync.GradientAccumulator(nn.Linear(4, 1), steps=1)
    assert len(list(sampler.iterate(acc))) == 4
