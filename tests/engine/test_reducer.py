"""Memory and graph features: bucket views, unused parameters, static graphs, misuse errors."""
import contextlib

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import gradsync
from gradsync.tools.launch import run_ranks
from helpers import Branches, assert_close_dicts, batches, grads, mlp, params, reference, reference_unused, shard


def train_views(rank, world_size, set_to_none, replace_grad):
    model = gradsync.DDP(mlp(seed=0), gradient_as_bucket_view=True, bucket_cap_mb=0.001,
                         first_bucket_cap_mb=0.0005)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    history, is_view = [], []
    for step, (x, y) in enumerate(batches(4, world_size)):
        opt.zero_grad(set_to_none=set_to_none)
        if replace_grad and step == 2:  # a user swaps in their own tensor: must still be correct
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
        F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
        history.append(grads(model.module))
        views = {p.grad.data_ptr() for p in model.parameters()}
        buffers = [(b.buffer.data_ptr(), b.buffer.data_ptr() + b.buffer.numel() * 4)
                   for b in model.reducer.buckets]
        is_view.append(all(any(lo <= v < hi for lo, hi in buffers) for v in views))
        opt.step()
    return history, is_view, params(model.module)


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("replace_grad", [False, True])
def test_gradient_as_bucket_view_is_exact_and_stays_a_view(set_to_none, replace_grad):
    results = run_ranks(train_views, 2, set_to_none, replace_grad)
    ref = mlp(seed=0)
    ref_history = reference(ref, batches(4, 2), opt=torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9))
    for history, is_view, final in results:
        for got, want in zip(history, ref_history):
            assert_close_dicts(got, want)
        assert all(is_view)
        assert_close_dicts(final, params(ref))


def unused(rank, world_size, pattern):
    model = gradsync.DDP(Branches(), find_unused_parameters=True)
    data = batches(len(pattern), world_size)
    for k, (x, y) in enumerate(data):
        use_b = pattern[k][rank]
        last = k == len(pattern) - 1
        loss = F.mse_loss(model(shard(x, rank, world_size), use_b=use_b), shard(y, rank, world_size))
        if last:
            loss.backward()
        else:
            with model.no_sync():
                loss.backward()
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in model.module.named_parameters()}


@pytest.mark.parametrize("case", ["all_ranks", "some_ranks", "only_under_no_sync", "none_unused"])
def test_find_unused_parameters(case):
    pattern = {
        "all_ranks": [(False, False)],
        "some_ranks": [(True, False)],
        "only_under_no_sync": [(True, True), (False, False)],  # pytorch#69031
        "none_unused": [(True, True), (True, True)],
    }[case]
    results = run_ranks(unused, 2, pattern)
    want = reference_unused(pattern, 2)
    b_used = any(u for step in pattern for u in step)
    for got in results:
        assert got["never.weight"] is None and got["never.bias"] is None
        if not b_used:
            assert got["b.weight"] is None
            want = {n: g for n, g in want.items() if not n.startswith("b.")}
        assert_close_dicts({n: g for n, g in got.items() if g is not None}, want)


def missing_flag(rank, world_size):
    model = gradsync.DDP(Branches())
    x, y = batches(1, world_size)[0]
    loss = F.mse_loss(model(shard(x, rank, world_size), use_b=rank == 0), shard(y, rank, world_size))
    with pytest.raises(RuntimeError) as info:
        loss.backward()
    return str(info.value)


class WithBranch(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.branch, self.head = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x, use):
        h = torch.tanh(self.a(x))
        return self.head(h) + self.branch(h) if use else self.head(h)


def branch_dropped_mid_window(rank, world_size, view):
    """A branch used only in a window's no_sync micro-step whose gradients zero_grad(set_to_none=True) then
    drops: its .grad stays None after the synced backward, so momentum SGD skips it, as in one process."""
    out = []
    for wrap in (lambda m: gradsync.DDP(m, find_unused_parameters=True, gradient_as_bucket_view=view), lambda m: m):
        model = wrap(module := WithBranch())
        part = (lambda t: shard(t, rank, world_size)) if model is not module else (lambda t: t)
        opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        for step, (x, y) in enumerate(batches(3, world_size, features=4)):
            y = y[:, :2]
            context = model.no_sync() if model is not module else contextlib.nullcontext()
            with context:
                F.mse_loss(model(part(x), True), part(y)).backward()
            if step == 1:
                opt.zero_grad(set_to_none=True)
            F.mse_loss(model(part(x), False), part(y)).backward()
            opt.step()
            opt.zero_grad()
        out.append(params(module))
    return out


@pytest.mark.parametrize("view", [False, True])
def test_a_branch_dropped_by_zero_grad_mid_window_keeps_its_none_grad(view):
    for ours, one_process in run_ranks(branch_dropped_mid_window, 2, view):
        assert_close_dicts(ours, one_process)


def test_missing_find_unused_flag_raises_on_every_rank_naming_parameters():
    for message in run_ranks(missing_flag, 2, timeout=30):
        assert "b.weight" in message and "b.bias" in message and "never.weight" in message
        assert "find_unused_parameters=True" in message
        assert "a.weight" not in message


def rebuild(rank, world_size):
    class Reordered(nn.Module):  # registration order differs from the order gradients arrive
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.late = nn.Linear(16, 4)
            self.early = nn.Linear(8, 16)

        def forward(self, x):
            return self.late(self.early(x))

    model = gradsync.DDP(Reordered(), bucket_cap_mb=0.0006, first_bucket_cap_mb=0.0003)
    before = model.reducer.bucket_plan()
    plans = []
    for x, y in batches(3, world_size):
        F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
        plans.append(model.reducer.bucket_plan())
    return before, plans, grads(model.module)


def test_buckets_are_rebuilt_once_from_the_observed_order():
    results = run_ranks(rebuild, 2)
    names = ["late.weight", "late.bias", "early.weight", "early.bias"]
    for before, plans, _ in results:
        # registration order reversed puts early.* first; gradients arrive for late.* first
        assert names[before[0][0]].startswith("early")
        assert names[plans[0][0][0]].startswith("late")
        assert plans[0] == plans[1] == plans[2]
    assert results[0][1] == results[1][1]


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=True)
        return self.head(h + torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=True))


def static(rank, world_size, static_graph):
    model = gradsync.DDP(Checkpointed(), static_graph=static_graph)
    out = []
    for step, (x, y) in enumerate(batches(3, world_size)):
        xs = shard(x, rank, world_size).requires_grad_()
        loss = F.mse_loss(model(xs), shard(y, rank, world_size))
        loss.backward()
        out.append(grads(model.module))
        for p in model.parameters():
            p.grad = None
    return out


def test_static_graph_handles_reentrant_checkpointing():
    results = run_ranks(static, 2, True)
    ref = Checkpointed()
    for step, (x, y) in enumerate(batches(3, 2)):
        for p in ref.parameters():
            p.grad = None
        F.mse_loss(ref(x.requires_grad_()), y).backward()
        for got in results:
            assert_close_dicts(got[step], grads(ref))


def test_reentrant_checkpointing_without_static_graph_raises_ready_twice():
    with pytest.raises(Exception, match="marked ready twice"):
        run_ranks(static, 2, False, timeout=30, pg_timeout=5)


class CheckpointedHead(nn.Module):
    """The last layer in a reentrant checkpoint: the backward's first gradients come from the checkpoint's own backward,
    nested in the outer one."""

    def __init__(self, unused=False):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = nn.Linear(8, 8), nn.Linear(8, 4)
        self.unused = nn.Linear(8, 4) if unused else None

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.head, torch.tanh(self.body(x)), use_reentrant=True)


HEAD_OPTIONS = {"default": {}, "views": {"gradient_as_bucket_view": True}, "static_graph": {"static_graph": True},
                "deterministic": {"deterministic": True}, "reduce_dtype": {"reduce_dtype": torch.float32},
                "accumulator": {}}


def checkpointed_head(rank, world_size, option):
    model = gradsync.DDP(CheckpointedHead(), bucket_cap_mb=0.001, **HEAD_OPTIONS[option])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = 2 if option == "accumulator" else 1
    acc = gradsync.GradientAccumulator(model, steps)
    opt = acc.wrap_optimizer(opt)
    for x, y in batches(4, world_size):
        for k in range(steps):
            rows = slice(k * 3, (k + 1) * 3) if steps == 2 else slice(None)
            with acc.accumulate():
                acc.backward(F.mse_loss(model(shard(x, rank, world_size)[rows]), shard(y, rank, world_size)[rows]))
            opt.step()
            opt.zero_grad()
    return params(model.module)


@pytest.mark.parametrize("option", list(HEAD_OPTIONS))
def test_a_reentrant_checkpoint_around_the_last_layer_trains_like_one_process(option):
    """The end-of-backward callback, queued at the first gradient, ran when the checkpoint's nested backward ended:
    the body's gradients were reported missing (static_graph: the step guard refused)."""
    ref = CheckpointedHead()
    reference(ref, batches(4, 2), opt=torch.optim.SGD(ref.parameters(), lr=0.1))
    for got in run_ranks(checkpointed_head, 2, option, timeout=60):
        assert_close_dicts(got, params(ref), atol=1e-6)


class SharedAcrossTheCheckpoint(nn.Module):
    """One layer used before the checkpointed head and again inside it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.shared, self.head = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.tail, torch.tanh(self.shared(x)), use_reentrant=True)

    def tail(self, h):
        return self.head(torch.tanh(self.shared(h)))


def shared_across(rank, world_size):
    model = gradsync.DDP(SharedAcrossTheCheckpoint(), static_graph=True, bucket_cap_mb=0.0001)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches(3, world_size):
        F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
        opt.step()
        opt.zero_grad()
    return params(model.module)


def test_static_graph_learns_a_parameter_used_inside_and_outside_a_checkpointed_head():
    """The first static_graph backward ended where the checkpoint's nested backward did, having seen the shared layer
    once: its second gradient came after, unsynchronized (torch's DDP queues its end from a node on the outputs)."""
    ref = SharedAcrossTheCheckpoint()
    reference(ref, batches(3, 2), opt=torch.optim.SGD(ref.parameters(), lr=0.1))
    for got in run_ranks(shared_across, 2, timeout=60):
        assert_close_dicts(got, params(ref), atol=1e-6)


def missing_beside_a_checkpointed_head(rank, world_size):
    model = gradsync.DDP(CheckpointedHead(unused=True))
    x, y = batches(1, world_size)[0]
    with pytest.raises(RuntimeError, match="received no gradient") as caught:
        F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
    return str(caught.value)


def test_a_parameter_without_gradient_beside_a_checkpointed_head_is_the_only_one_named():
    for message in run_ranks(missing_beside_a_checkpointed_head, 2, timeout=60):
        assert "2 parameter(s)" in message and "unused.weight, unused.bias" in message, message


def static_changes(rank, world_size):
    model = gradsync.DDP(Branches(), static_graph=True)
    for step, (x, y) in enumerate(batches(3, world_size)):
        loss = F.mse_loss(model(shard(x, rank, world_size), use_b=step < 2), shard(y, rank, world_size))
        if step < 2:
            loss.backward()
        else:
            with pytest.raises(RuntimeError, match="static_graph=True.*b.weight.*graph changed"):
                loss.backward()


def test_static_graph_that_changes_raises():
    run_ranks(static_changes, 2, timeout=30)


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.f32 = nn.Linear(8, 8)
        self.f64 = nn.Linear(8, 8).double()
        self.bf16 = nn.Linear(8, 8).to(torch.bfloat16)
        self.frozen = nn.Linear(8, 4).requires_grad_(False)

    def forward(self, x):
        h = self.f64(self.f32(x).double()).float()
        h = self.bf16(h.bfloat16()).float()
        return self.frozen(h)


def mixed(rank, world_size):
    model = gradsync.DDP(Mixed())
    dtypes = [{model.reducer.params[i].dtype for i in b.members} for b in model.reducer.buckets]
    x, y = batches(1, world_size)[0]
    F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
    return dtypes, grads(model.module), model.module.frozen.weight.grad


def test_mixed_dtypes_get_separate_buckets_and_frozen_params_are_left_alone():
    results = run_ranks(mixed, 2)
    want = reference(Mixed(), batches(1, 2))[0]
    for dtypes, got, frozen_grad in results:
        assert all(len(d) == 1 for d in dtypes) and len(dtypes) == 3
        assert frozen_grad is None and "frozen.weight" not in got
        for name in want:
            tol = 2e-2 if name.startswith("bf16") else 1e-5
            torch.testing.assert_close(got[name], want[name], atol=tol, rtol=tol)


def changed_after_wrapping(rank, world_size, how, trained):
    module = mlp()
    if how == "unfrozen":  # frozen at construction: it has no hook and no slot
        module[0].bias.requires_grad_(False)
    model = gradsync.DDP(module, static_graph=how == "frozen")  # static_graph promises the same gradients each time
    if trained:  # the wrapper keeps its walk of the module tree: a change must still be seen
        model(torch.randn(2, 8)).sum().backward()
    if how == "removed":
        del module[0].bias
    elif how == "added":
        module.extra = nn.Linear(2, 2)
    elif how == "frozen":
        module[0].weight.requires_grad_(False)
    elif how == "unfrozen":
        module[0].bias.requires_grad_(True)
    else:
        module[-1].bias.requires_grad_(True)
        module[0].bias.requires_grad_(False)
        module[0].bias.requires_grad_(True)
        module[-1].weight = nn.Parameter(module[-1].weight.detach().clone())
    expected = {"frozen": "parameter '0.weight' was frozen .* wrap the module again after the change",
                "unfrozen": "parameter '0.bias' was unfrozen .* required gradients at construction"}.get(
                    how, "parameters changed after it was wrapped")
    with pytest.raises(RuntimeError, match=expected):
        model(torch.randn(2, 8))


@pytest.mark.parametrize("how,trained", [("added", False), ("frozen", False), ("replaced", False), ("unfrozen", False),
                                         ("added", True), ("frozen", True), ("replaced", True), ("removed", True)])
def test_parameters_changed_after_wrapping_raise(how, trained):
    run_ranks(changed_after_wrapping, 2, how, trained)


def freeze_then_wrap_again(rank, world_size):
    """The advice of the frozen-layer error, followed: freeze the first layer after two steps, wrap again."""
    def train(module, wrap, part):
        opt, model = torch.optim.SGD(module.parameters(), lr=0.1), wrap(module)
        for k, (x, y) in enumerate(batches(4, world_size)):
            if k == 2:
                module[0].weight.requires_grad_(False)
                model = wrap(module)
            opt.zero_grad()
            F.mse_loss(model(part(x)), part(y)).backward()
            opt.step()
        return params(module)
    return (train(mlp(seed=0), gradsync.DDP, lambda t: shard(t, rank, world_size)),
            train(mlp(seed=0), lambda m: m, lambda t: t))


def test_a_layer_frozen_by_wrapping_again_trains_like_one_process():
    for ours, one_process in run_ranks(freeze_then_wrap_again, 2):
        assert_close_dicts(ours, one_process)
        assert not torch.equal(ours["0.bias"], mlp(seed=0)[0].bias.detach())  # the layer's bias trained on


def freeze_and_unfreeze(rank, world_size, view):
    """Progressive unfreezing with one AdamW over every parameter (weight decay moves any parameter that has a
    gradient): the first layer frozen after wrapping for two steps, then trained again."""
    def train(module, wrap, part):
        opt, model, seen = torch.optim.AdamW(module.parameters(), lr=0.05, weight_decay=0.5), wrap(module), []
        for k, (x, y) in enumerate(batches(6, world_size)):
            if k in (2, 4):
                module[0].requires_grad_(k == 4)
            opt.zero_grad()
            F.mse_loss(model(part(x)), part(y)).backward()
            opt.step()
            seen.append(params(module[0]))
        return params(module), seen
    return (train(mlp(seed=0), lambda m: gradsync.DDP(m, gradient_as_bucket_view=view),
                  lambda t: shard(t, rank, world_size)),
            train(mlp(seed=0), lambda m: m, lambda t: t))


@pytest.mark.parametrize("view", [False, True])
def test_a_layer_frozen_and_unfrozen_after_wrapping_trains_like_one_process(view):
    for (ours, seen), (one_process, _) in run_ranks(freeze_and_unfreeze, 2, view):
        assert_close_dicts(ours, one_process)
        assert_close_dicts(seen[1], seen[3], atol=0, rtol=0)  # frozen for steps 2 and 3: not a bit moved
        assert not seen[3]["weight"].equal(seen[5]["weight"])  # trained again


def gan_step_freeze(rank, world_size):
    """pix2pix/CycleGAN: the wrapped discriminator frozen for the generator's step, unfrozen for its own."""
    out = []
    for wrap in (gradsync.DDP, TorchDDP):
        torch.manual_seed(0)
        G, D = wrap(nn.Linear(4, 6)), wrap(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)))
        og, od = torch.optim.SGD(G.parameters(), lr=0.1), torch.optim.AdamW(D.parameters(), lr=0.1)
        for s in range(3):
            g = torch.Generator().manual_seed(10 * s + rank)
            real, z = torch.randn(4, 6, generator=g), torch.randn(4, 4, generator=g)
            D.requires_grad_(True)
            od.zero_grad()
            (F.softplus(D(G(z).detach())).mean() + F.softplus(-D(real)).mean()).backward()
            od.step()
            D.requires_grad_(False)
            og.zero_grad()
            F.softplus(-D(G(z))).mean().backward()
            og.step()
        out.append([p.detach().clone() for p in list(G.parameters()) + list(D.parameters())])
    return out


def test_a_discriminator_frozen_for_the_generator_step_trains_like_torch():
    for ours, theirs in run_ranks(gan_step_freeze, 2):
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)


def test_the_module_walk_is_kept_until_a_module_changes():
    from gradsync.ddp.snapshot import module_tensors, snapshot
    module = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    snap = snapshot(module)
    first = module_tensors(module, snap)
    assert module_tensors(module, snap) is first  # nothing changed: no walk
    assert first == (list(module.parameters()), list(module.buffers()))
    module[0].register_buffer("scale", torch.ones(2))  # a module's own slots changed: walked again
    again = module_tensors(module, snap)
    assert again is not first and again[1] == list(module.buffers()) and len(again[1]) == len(first[1]) + 1
    module[1] = nn.BatchNorm1d(2)  # a child replaced
    assert module_tensors(module, snap)[1] == list(module.buffers())
    module[0]._parameters["weight"] = nn.Parameter(torch.ones(2, 2))  # a value replaced in place: same lengths
    assert module_tensors(module, snap)[0] == list(module.parameters())
    module[1].running_mean = torch.zeros(2)
    assert module_tensors(module, snap)[1] == list(module.buffers())
    del module[0].scale  # a value removed
    assert module_tensors(module, snap)[1] == list(module.buffers())


def misuse(rank, world_size, what):
    if what == "double_backward":
        model = gradsync.DDP(mlp())
        loss = model(torch.randn(2, 8)).sum()
        loss.backward(retain_graph=True)
        with pytest.warns(UserWarning, match="backward ran without a forward"):  # local, as in torch
            loss.backward()
    elif what == "wrap_twice":
        inner = mlp()
        model = gradsync.DDP(inner)
        with pytest.raises(ValueError, match="already wrapped"):
            gradsync.DDP(model)
        with pytest.raises(ValueError, match="already wrapped"):
            gradsync.DDP(nn.parallel.DistributedDataParallel(mlp()))
        outer = gradsync.DDP(nn.Sequential(inner))  # takes over inner's parameters
        with pytest.raises(RuntimeError, match="wrapped again by a newer"):
            model(torch.randn(2, 8))
        outer(torch.randn(2, 8)).sum().backward()
    elif what == "lazy":
        with pytest.raises(ValueError, match="lazy"):
            gradsync.DDP(nn.LazyLinear(4))
    elif what == "bad_timeout":
        with pytest.raises(ValueError, match="timeout"):
            gradsync.DDP(mlp(), timeout=-1)


@pytest.mark.parametrize("what", ["double_backward", "wrap_twice", "lazy", "bad_timeout"])
def test_misuse_errors(what):
    run_ranks(misuse, 2, what)


# ---------------------------------------------------------------- parity with torch's DDP
def with_both(rank, world_size, scenario):
    """Run ``scenario(wrap, rank, world_size)`` with torch's DDP, then gradsync, in one process group."""
    return {name: scenario(wrap, rank, world_size)
            for name, wrap in (("torch", nn.parallel.DistributedDataParallel), ("gradsync", gradsync.DDP))}


class Square(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.tensor(1.0))

    def forward(self, x):
        return (self.p * x).pow(2).sum()


def create_graph(wrap, rank, world_size):
    model = wrap(Square())
    for step in range(3):  # gradients accumulate, as in torch's test_ddp_create_graph
        model(torch.tensor(float(rank + step))).backward(create_graph=True)
    return {n: p.grad.detach() for n, p in model.module.named_parameters()}


def create_graph_penalty(wrap, rank, world_size, view=False, hook=False):
    """A penalty on the averaged .grad, differentiated: .grad's graph is this rank's gradient / world size."""
    model = wrap(Square(), gradient_as_bucket_view=view)
    if hook:  # the hook's result is the average; the graph stays the local gradient, undivided, as in torch
        model.register_comm_hook(None, torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook)
    model(torch.tensor(float(rank + 1))).backward(create_graph=True)
    p = model.module.p
    (penalty,) = torch.autograd.grad(p.grad.square().sum() + p.sum(), [p])
    return {"grad": p.grad.detach(), "penalty": penalty}


def create_graph_penalty_views(wrap, rank, world_size):
    return create_graph_penalty(wrap, rank, world_size, view=True)


def create_graph_penalty_hook(wrap, rank, world_size):
    return create_graph_penalty(wrap, rank, world_size, hook=True)


def undefined_grads(wrap, rank, world_size):
    model = wrap(mlp(seed=0), find_unused_parameters=True)
    torch._C._functions.UndefinedGrad()(model(torch.randn(2, 8)).sum()).backward()
    return {n: p.grad for n, p in model.module.named_parameters()}


def forwards_then_backwards(wrap, rank, world_size):
    """Accelerate's pattern: forwards under no_sync, then backwards, the last one made to sync."""
    model = wrap(mlp(seed=0))
    losses = []
    for x, y in batches(3, world_size):
        with model.no_sync():
            losses.append(F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)))
    history = []
    for k, loss in enumerate(losses):
        if k == len(losses) - 1:
            model.reducer.prepare_for_backward([])  # as accelerate's trigger_sync_in_backward does
        loss.backward()  # outside no_sync: the forward's no_sync decides, as in torch
        history.append(grads(model.module))
    return history


def bypassed_forward(wrap, rank, world_size):
    """A backward through the inner module is local; the next synced backward reduces its gradient."""
    model = wrap(mlp(seed=0))
    x, y = batches(2, world_size)[0]
    F.mse_loss(model.module(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
    local = grads(model.module)
    F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
    return local, grads(model.module)


@pytest.mark.parametrize("scenario", [create_graph, create_graph_penalty, create_graph_penalty_views,
                                      create_graph_penalty_hook, undefined_grads, forwards_then_backwards, bypassed_forward],
                         ids=lambda f: f.__name__)
def test_matches_torch_ddp(scenario):
    for result in run_ranks(with_both, 2, scenario):
        theirs, ours = result["torch"], result["gradsync"]
        for a, b in zip(*(r if isinstance(r, (list, tuple)) else [r] for r in (theirs, ours))):
            assert a.keys() == b.keys()
            for name in a:
                if a[name] is None or b[name] is None:
                    assert a[name] is None and b[name] is None, name  # undefined stays None
                else:
                    torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=1e-6, msg=name)
