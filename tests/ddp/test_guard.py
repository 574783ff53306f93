"""An optimizer step on gradients that local backwards left unsynchronized raises on every rank."""
import gc

import types

import pytest
import torch
import torch.nn.functional as F

import gradsync
from gradsync.tools.launch import run_ranks
from helpers import batches, mlp, params, shard

UNSYNCED = "unsynchronized gradients"


def _loss(model, x, y):
    return F.mse_loss(model(x), y)


def bypassed(rank, world_size, how):
    """The optimizer steps on every micro-step although the gradients are only synced every 2nd."""
    model = gradsync.DDP(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = params(model.module)
    x, y = [shard(t, rank, world_size) for t in batches(1, world_size)[0]]
    if how == "accumulator":
        acc = gradsync.GradientAccumulator(model, steps=2)
        with acc.accumulate():
            acc.backward(_loss(model, x, y))
    elif how == "no_sync":
        with model.no_sync():
            _loss(model, x, y).backward()
    elif how == "attribute":  # nanoGPT style
        model.require_backward_grad_sync = False
        _loss(model, x, y).backward()
    elif how == "second_backward":  # synced, then a second (local) backward through the same forward
        loss = _loss(model, x, y)
        loss.backward(retain_graph=True)
        with pytest.warns(UserWarning, match="without a forward"):
            loss.backward()
    if how == "closure":  # the closure's backward runs inside step(): checked after it
        def closure():
            with model.no_sync():
                loss = _loss(model, x, y)
                loss.backward()
            return loss
        with pytest.raises(RuntimeError, match=f"{UNSYNCED}.*wrap_optimizer"):
            opt.step(closure)
    else:
        with pytest.raises(RuntimeError, match=f"{UNSYNCED}.*wrap_optimizer"):
            opt.step()
    after = params(model.module)
    assert all(torch.equal(before[k], after[k]) for k in before)  # raised before changing anything


@pytest.mark.parametrize("how", ["accumulator", "no_sync", "attribute", "second_backward", "closure"])
def test_optimizer_step_on_unsynchronized_gradients_raises_on_every_rank(how):
    run_ranks(bypassed, 2, how)


def legit(rank, world_size, how):
    torch.manual_seed(0)
    model = gradsync.DDP(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [[shard(t, rank, world_size) for t in b] for b in batches(4, world_size)]
    if how == "accumulator":
        acc = gradsync.GradientAccumulator(model, steps=2)
        opt = acc.wrap_optimizer(opt)
        for x, y in acc.iterate(data):
            with acc.accumulate():
                acc.backward(_loss(model, x, y))
                opt.step()
                opt.zero_grad()
    elif how == "plain":
        for x, y in data:
            _loss(model, x, y).backward()
            opt.step()
            opt.zero_grad()
    elif how == "manual_window":
        for k, (x, y) in enumerate(data):
            model.require_backward_grad_sync = k % 2 == 1
            _loss(model, x, y).backward()
            if k % 2 == 1:
                opt.step()
                opt.zero_grad()
    elif how == "noop_hook":
        model.register_comm_hook(None, gradsync.noop_hook)
        for x, y in data:
            _loss(model, x, y).backward()
            opt.step()
    elif how == "closure":  # Lightning style: the window's synced backward runs in step(closure)
        with model.no_sync():
            _loss(model, *data[0]).backward()

        def closure():
            loss = _loss(model, *data[1])
            loss.backward()
            return loss
        opt.step(closure=closure)
    elif how == "discarded":  # a window's local gradients dropped with zero_grad
        with model.no_sync():
            _loss(model, *data[0]).backward()
        opt.zero_grad()
        opt.step()
    elif how == "other_model":  # another model's optimizer steps while this one accumulates
        other = torch.nn.Linear(3, 3)
        other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
        with model.no_sync():
            _loss(model, *data[0]).backward()
        other(torch.randn(2, 3)).sum().backward()
        other_opt.step()
    elif how == "deleted_wrapper":  # the wrapper is gone: its parameters train locally
        with model.no_sync():
            _loss(model, *data[0]).backward()
        del model
        gc.collect()
        opt.step()


@pytest.mark.parametrize("how", ["accumulator", "plain", "manual_window", "noop_hook", "closure", "discarded",
                                 "other_model", "deleted_wrapper"])
def test_legitimate_steps_do_not_raise(how):
    run_ranks(legit, 2, how)


def single_rank(rank, world_size):
    model = gradsync.DDP(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.no_sync():
        model(torch.randn(4, 8)).sum().backward()
    opt.step()  # one rank: nothing to synchronize


def test_world_size_one_does_not_raise():
    run_ranks(single_rank, 1)


def sharded_with_torch_optimizer(rank, world_size, sync):
    model = gradsync.ShardedDataParallel(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.require_backward_grad_sync = sync
    model(torch.randn(4, 8)).sum().backward()
    with pytest.raises(RuntimeError, match="ShardedDataParallel.*gradsync.ShardedOptimizer"):
        opt.step()  # synced: .grad is None, so it would do nothing; local: unsynchronized
    del opt, model
    gc.collect()


@pytest.mark.parametrize("sync", [True, False])
def test_torch_optimizer_on_a_sharded_model_raises(sync):
    run_ranks(sharded_with_torch_optimizer, 2, sync)


class Recording(torch.optim.SGD):
    """SGD that remembers the closure its step() received (after the global pre-hooks ran)."""

    def step(self, closure=None):
        self.seen = closure
        return super().step(closure)


def unrelated_optimizer():
    """An optimizer over parameters no gradsync model owns, and a closure that back-propagates them."""
    other = torch.nn.Linear(3, 3)

    def closure():
        loss = other(torch.randn(2, 3)).sum()
        loss.backward()
        return loss
    return Recording(other.parameters(), lr=0.1), closure


def unrelated_closure(rank, world_size):
    model = gradsync.ShardedDataParallel(mlp())  # registers with the guard on any world size
    opt, closure = unrelated_optimizer()
    opt.step(closure)
    assert opt.seen is closure  # no gradsync model touches it: the guard stays out of its way
    opt.step(closure=closure)
    assert opt.seen is closure
    mine = Recording(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="gradsync.ShardedOptimizer"):
        mine.step(lambda: model(torch.randn(4, 8)).sum().backward())  # checked after the closure
    assert mine.seen is not None


def test_an_optimizer_no_model_touches_gets_its_closure_unwrapped():
    run_ranks(unrelated_closure, 1)


class FakeReducer:
    """What the guard reads of a reducer: its parameters, its unsynced flag and window, its store."""

    def __init__(self, params):
        self.params = list(params)
        self.names = [f"p{i}" for i in range(len(self.params))]
        self.config, self.unsynced = types.SimpleNamespace(wrapper_name="Fake"), False
        self.window_used = [False] * len(self.params)
        self.store = self

    def has_local_grad(self, i):
        return True

    def check_foreign_step(self, optimizer):
        pass


def registered_reducers(rank, world_size):
    from gradsync.ddp import guard
    owned, other = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    reducer = FakeReducer(owned.parameters())
    guard.install(reducer)
    mine, theirs = Recording(owned.parameters(), lr=0.1), Recording(other.parameters(), lr=0.1)

    def closure():
        reducer.window_used[0] = reducer.unsynced = True  # its backward leaves a gradient unsynchronized
        return 0.0
    theirs.step(closure)
    assert theirs.seen is closure
    owned.weight.grad = torch.ones_like(owned.weight)
    with pytest.raises(RuntimeError, match=f"{UNSYNCED}.*'p0'"):
        mine.step(closure)
    guard.forget(reducer)  # the wrapper is gone: its parameters train locally

    def plain():
        return 0.0
    mine.step(plain)
    assert mine.seen is plain


def test_only_optimizers_of_registered_reducers_get_their_closure_checked():
    run_ranks(registered_reducers, 1)


def unrelated_closure_ddp(rank, world_size):
    model = gradsync.DistributedDataParallel(mlp())
    opt, closure = unrelated_optimizer()
    opt.step(closure)
    unrelated = opt.seen is closure
    mine = Recording(model.parameters(), lr=0.1)

    def local_backward():  # a no_sync backward inside the closure: caught after it, before the update
        with model.no_sync():
            model(torch.randn(4, 8)).sum().backward()
    with pytest.raises(RuntimeError, match="unsynchronized"):
        mine.step(local_backward)
    return unrelated, mine.seen is not local_backward


def test_a_ddp_models_guard_leaves_other_optimizers_closures_alone():
    for unrelated_untouched, own_checked in run_ranks(unrelated_closure_ddp, 2):
        assert unrelated_untouched and own_checked


def regrouped(rank, world_size):
    """The optimizer's parameter list is replaced by a new list of the same length, which CPython may put where
    the old one was: the guard must see the new parameters, not what it remembered of the old list."""
    model = gradsync.DDP(mlp())
    outside = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([outside], lr=0.1)
    outside.grad = torch.ones(3)
    x, y = [shard(t, rank, world_size) for t in batches(1, world_size)[0]]
    with model.no_sync():
        _loss(model, x, y).backward()
    opt.step()  # the outside parameter only: no unsynchronized gradient
    group, (unsynced, *_) = opt.param_groups[0], list(model.parameters())
    held, old = [], id(group["params"])
    del group["params"]
    while len(held) < 1000 and id(new := [unsynced]) != old:  # CPython's list free list gives it at once, unless
        held.append(new)  # the old list is still alive (the guard holding it is what keeps its address unique)
    group["params"] = new
    with pytest.raises(RuntimeError, match=UNSYNCED):
        opt.step()


def test_a_replaced_parameter_list_at_the_same_address_is_checked_again():
    run_ranks(regrouped, 2)


def collected_during_the_walk(rank, world_size):
    from gradsync import process
    model = gradsync.ShardedDataParallel(mlp(seed=0))  # an exclusive store: the guard walks it at every step
    model.cycle = model  # only a collection frees it; its finalizer then takes its reducer out of the guard's sets
    del model

    class Collecting:  # a reducer whose parameters' walk runs a collection, as any allocation may
        @property
        def params(self):
            gc.collect()
            return []
    reducer = Collecting()
    process.state.guard_exclusive.add(reducer)
    process.state.guard_version += 1
    try:
        torch.optim.SGD(mlp(seed=1).parameters(), lr=0.1).step()
    finally:
        process.state.guard_exclusive.discard(reducer)
    return True


def test_a_wrapper_collected_while_the_guard_walks_its_reducers_does_not_break_the_step():
    """Seen as "RuntimeError: Set changed size during iteration" from optimizer.step() when a collection ran inside
    the guard's walk of its weak sets."""
    gc.disable()  # the forked ranks: only the collection inside the walk frees the model
    try:
        assert run_ranks(collected_during_the_walk, 2) == [True, True]
    finally:
        gc.enable()


def optimizer_in_backward(rank, world_size, kw):
    """torch's tutorial "fuse the optimizer step into the backward": a per-parameter optimizer stepped in a
    post-accumulate-grad hook. Every hook runs before the reducer's, on this rank's own gradient."""
    torch.manual_seed(0)
    net = mlp(seed=0)
    optimizers = {p: torch.optim.SGD([p], lr=0.1) for p in net.parameters()}
    for p in net.parameters():
        p.register_post_accumulate_grad_hook(lambda p: (optimizers[p].step(), optimizers[p].zero_grad()))
    model = gradsync.DDP(net, **kw)
    before = params(net)
    x, y = batches(1, world_size)[0]
    with pytest.raises(RuntimeError, match="ran inside a backward.*optimizer stepped in backward"):
        F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
    return sum(not torch.equal(before[n], p) for n, p in net.named_parameters())


@pytest.mark.parametrize("kw", [{}, {"deterministic": True}, {"reduce_dtype": torch.float32}],
                         ids=["default", "deterministic", "reduce_dtype"])
def test_an_optimizer_stepped_in_backward_raises_before_it_changes_a_parameter(kw):
    """The replicas drifted apart silently (as under torch's DDP): each rank stepped on its own gradients."""
    assert run_ranks(optimizer_in_backward, 2, kw, timeout=60) == [0, 0]


def overlapped_and_plain(rank, world_size):
    """overlap_optimizer steps each bucket inside the synced backward once it is reduced: no refusal."""
    model = gradsync.DDP(mlp(seed=0), bucket_cap_mb=0.001)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gradsync.overlap_optimizer(model, optimizer)
    for x, y in batches(2, world_size):
        F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
        optimizer.step()  # marks where the step ends: the buckets stepped inside the backward
        optimizer.zero_grad()
    return params(model.module)


def test_overlap_optimizer_steps_inside_the_backward_without_a_refusal():
    a, b = run_ranks(overlapped_and_plain, 2, timeout=60)
    assert all(torch.equal(a[n], b[n]) for n in a)


def averaged_then_stepped_in_another_backward(rank, world_size, through_a_model):
    """Model B's optimizer stepped from a hook in another backward (model A's, or one through no model), after B's
    own synced backward averaged its gradients: nothing to refuse."""
    torch.manual_seed(0)
    a, b = gradsync.DDP(torch.nn.Linear(4, 2)), gradsync.DDP(torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(b.parameters(), lr=0.1)
    torch.manual_seed(rank)
    x = torch.randn(8, 4)
    b(x).pow(2).mean().backward()
    out = a(x) if through_a_model else torch.ones(3, requires_grad=True) * 2
    out.register_hook(lambda grad: optimizer.step())
    out.pow(2).mean().backward()
    return b.module.weight.detach().clone()


@pytest.mark.parametrize("through_a_model", [True, False], ids=["another_model", "no_model"])
def test_a_step_on_averaged_gradients_inside_another_backward_is_let_through(through_a_model):
    a, b = run_ranks(averaged_then_stepped_in_another_backward, 2, through_a_model, timeout=60)
    assert torch.equal(a, b)
