"""A local backward's hooks are taken out after its first and put back at its end, and with views a window's first
lends its small gradients their zeroed views (engine/quiet.py): nothing the hooks would have done is lost, also
when that backward raises part-way, replaces ``.grad`` or does not reach a parameter."""
import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F

import gradsync
from gradsync._torch import post_accumulate_hooks
from gradsync.tools.launch import run_ranks
from helpers import batches, shard


class Boom(torch.autograd.Function):
    """Raises in its backward, after the head's gradients were accumulated: a backward that fails part-way."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("boom")


class Faulty(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.head, self.fail = torch.nn.Linear(8, 32), torch.nn.Linear(32, 4), False

    def forward(self, x):
        h = torch.tanh(self.first(x))
        return self.head(Boom.apply(h) if self.fail else h)


def micro_steps(model, rank, world_size, data, failing):
    """Two local backwards (the second raises when ``failing``), then a synced one."""
    (xa, ya), (xb, yb), (xc, yc) = [(shard(x, rank, world_size), shard(y, rank, world_size)) for x, y in data]
    wrapped = isinstance(model, gradsync.DDP)
    module = model.module if wrapped else model
    with model.no_sync() if wrapped else contextlib.nullcontext():
        F.mse_loss(model(xa), ya).backward()
        module.fail = failing
        try:
            F.mse_loss(model(xb), yb).backward()
        except RuntimeError as exc:
            assert failing and "boom" in str(exc)
        finally:
            module.fail = False
    return xc, yc


def failed_then_synced(rank, world_size, view):
    model = gradsync.DDP(Faulty(), gradient_as_bucket_view=view, bucket_cap_mb=1e-4)  # a bucket per parameter
    data = batches(4, world_size)
    xs, ys = data[3]
    F.mse_loss(model(shard(xs, rank, world_size)), shard(ys, rank, world_size)).backward()  # .grad are views now
    for p in model.parameters():
        p.grad.zero_()
    xc, yc = micro_steps(model, rank, world_size, data[:3], failing=True)
    muted = [len(post_accumulate_hooks(p)) for p in model.parameters()]
    F.mse_loss(model(xc), yc).backward()  # the forward puts them back: this backward reduces
    back = [len(post_accumulate_hooks(p)) for p in model.parameters()]
    ref = Faulty()  # each rank's window alone (the failed backward's head gradients kept), then their mean
    total = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
    for r in range(world_size):
        ref.zero_grad()
        xr, yr = micro_steps(ref, r, world_size, data[:3], failing=True)
        F.mse_loss(ref(xr), yr).backward()
        for n, p in ref.named_parameters():
            total[n] += p.grad / world_size
    got = {n: p.grad.clone() for n, p in model.module.named_parameters()}
    views = [p.grad.data_ptr() == v.data_ptr() for p, v in zip(model.parameters(), model.reducer.store.views)]
    return muted, back, got, total, views


@pytest.mark.parametrize("view", [True, False], ids=["views", "copy"])
def test_a_local_backward_that_raises_leaves_the_hooks_out_until_the_next_forward(view):
    for muted, back, got, expected, views in run_ranks(failed_then_synced, 2, view):
        assert muted == [0, 0, 0, 0], muted  # the raise left them out: its end of backward never ran
        assert back == [1, 1, 1, 1], back
        for n in expected:
            torch.testing.assert_close(got[n], expected[n], rtol=1e-6, atol=1e-7)
        assert all(views) == view


def with_a_user_hook(rank, world_size):
    model = gradsync.DDP(Faulty(), gradient_as_bucket_view=True)
    calls = []
    for n, p in model.module.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: calls.append(n))
    data = batches(3, world_size)
    for window in range(2):
        model.zero_grad(set_to_none=True)
        xc, yc = micro_steps(model, rank, world_size, data, failing=False)
        F.mse_loss(model(xc), yc).backward()
    return len(calls), [list(post_accumulate_hooks(p)) for p in model.parameters()], model.reducer.handles


def test_a_users_hooks_run_in_every_backward_before_the_reducers():
    for count, keys, handles in run_ranks(with_a_user_hook, 2):
        assert count == 2 * 3 * 4  # windows x backwards x parameters
        assert [k[-1] for k in keys] == [h.id for h in handles]  # the reducer's last, as torch's after AccumulateGrad


def create_graph_locally(rank, world_size):
    model = gradsync.DDP(Faulty(), gradient_as_bucket_view=True)
    data = batches(3, world_size)
    (xa, ya), (xb, yb) = [(shard(x, rank, world_size), shard(y, rank, world_size)) for x, y in data[:2]]
    F.mse_loss(model(xa), ya).backward()  # synced: .grad are views
    before = {n: p.grad.clone() for n, p in model.module.named_parameters()}
    with model.no_sync(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = F.mse_loss(model(xb), yb)
        local = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
        # autograd replaces each .grad (old + new), the first hook's too: that backward keeps its hooks, and each
        # complete bucket takes its new .grad back into the views
        loss.backward(create_graph=True)
    views = [p.grad.data_ptr() == v.data_ptr() for p, v in zip(model.parameters(), model.reducer.store.views)]
    sums = [torch.allclose(p.grad.detach(), before[n] + g, rtol=1e-6, atol=1e-7)
            for (n, p), g in zip(model.module.named_parameters(), local)]
    return views, sums


def test_a_local_backward_that_replaces_grad_takes_it_back_into_the_views():
    for views, sums in run_ranks(create_graph_locally, 2):
        assert all(views) and all(sums), (views, sums)


def seen_mid_backward(rank, world_size, caps):
    """During each backward of a window with views, when the first layer's gradient arrives (late): how many of the
    reducer's hooks are in their dicts, and whether the head's .grad are their bucket views."""
    model = gradsync.DDP(Faulty(), gradient_as_bucket_view=True, **caps)
    views = dict(zip(model.parameters(), model.reducer.store.views))
    head = list(model.module.head.parameters())
    seen = []
    model.module.first.weight.register_hook(lambda g: seen.append(
        (sum(len(post_accumulate_hooks(p)) for p in model.parameters()), [p.grad is views[p] for p in head])))
    (x, y), = [(shard(x, rank, world_size), shard(y, rank, world_size)) for x, y in batches(1, world_size)]
    F.mse_loss(model(x), y).backward()
    for first in (True, False):  # the window's first micro-step (every .grad None), then its second
        if first:
            model.zero_grad(set_to_none=True)
        with model.no_sync():
            F.mse_loss(model(x), y).backward()
    return seen, all(p.grad is v for p, v in views.items())


@pytest.mark.parametrize("caps", [{}, {"bucket_cap_mb": 1e-4}], ids=["one-bucket", "a-bucket-per-parameter"])
def test_a_first_local_backward_accumulates_into_the_views(caps):
    # after zero_grad(set_to_none=True) the first hook makes each small .grad its view (all of them here): autograd
    # adds the rest in place, so none lives outside the buckets, however many buckets; the hooks are out from there on
    for seen, views in run_ranks(seen_mid_backward, 2, caps):
        assert seen[0][0] == 4 and seen[1:] == [(0, [True, True])] * 2, seen  # synced; first local; second local
        assert views


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4), torch.nn.Linear(16, 4)

    def forward(self, x, both=True):
        h = torch.tanh(self.body(x))
        return self.a(h) + self.b(h) if both else self.a(h)


def head_unreached_first(rank, world_size):
    """A window whose first local backward does not reach head ``b``; its second and the synced one do. gradsync
    with views against torch's DDP with views, in the same group, two windows, SGD."""
    data = batches(3, world_size)
    out = {}
    for name, wrap in (("gradsync", gradsync.DDP), ("torch", torch.nn.parallel.DistributedDataParallel)):
        model = wrap(TwoHeads(), gradient_as_bucket_view=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for window in range(2):
            opt.zero_grad(set_to_none=True)
            with model.no_sync():
                for k, (x, y) in enumerate(data[:2]):
                    F.mse_loss(model(shard(x, rank, world_size), both=k == 1), shard(y, rank, world_size)).backward()
                    if k == 0:
                        unreached = model.module.b.weight.grad
                        out[name + " unreached"] = None if unreached is None else unreached.clone()
            x, y = data[2]
            F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
            out[f"{name} grads {window}"] = {n: p.grad.clone() for n, p in model.module.named_parameters()}
            opt.step()
    return out


def test_a_parameter_the_first_local_backward_does_not_reach_gets_what_torch_gives_it():
    # the first hook makes each small .grad its zeroed view: one the backward does not reach holds zeros (torch's: None);
    # what the window reduces and the step it takes are torch's
    for out in run_ranks(head_unreached_first, 2):
        assert out["torch unreached"] is None and torch.equal(out["gradsync unreached"], torch.zeros(4, 16))
        for window in range(2):
            got, expected = out[f"gradsync grads {window}"], out[f"torch grads {window}"]
            for n in expected:
                torch.testing.assert_close(got[n], expected[n], rtol=1e-6, atol=1e-7)


class SmallAndLarge(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.small, self.large = torch.nn.Linear(8, 64), torch.nn.Linear(64, 4), torch.nn.Linear(64, 128)

    def forward(self, x):
        h = torch.tanh(self.first(x))
        return self.small(h).sum(1, keepdim=True) + self.large(h).sum(1, keepdim=True)


def lent_or_kept(rank, world_size):
    """In a window's first local backward, when the first layer's gradient arrives: which .grad are their views."""
    model = gradsync.DDP(SmallAndLarge(), gradient_as_bucket_view=True)
    views = dict(zip(model.parameters(), model.reducer.store.views))
    heads = {"small.weight": model.module.small.weight, "large.weight": model.module.large.weight}
    seen = {}
    model.module.first.weight.register_hook(lambda g: seen.update({n: p.grad is views[p] for n, p in heads.items()}))
    x, y = shard(torch.randn(8, 8), rank, world_size), shard(torch.randn(8, 1), rank, world_size)
    with model.no_sync():
        F.mse_loss(model(x), y).backward()
    return seen, all(p.grad is v for p, v in views.items()), heads["large.weight"].numel() * 4


def test_a_first_local_backward_lends_views_to_small_gradients_only():
    # a small gradient is added into its zeroed view; a large one (adding into a zeroed view would pass over its
    # memory twice more than autograd's own tensor and one copy) stays autograd's until the backward's end
    from gradsync.engine.quiet import LEND_BYTES
    for seen, views, large in run_ranks(lent_or_kept, 2):
        assert large > LEND_BYTES
        assert seen == {"small.weight": True, "large.weight": False} and views, seen
