"""ShardedDataParallel + ShardedOptimizer against torch's DDP + the same optimizer, in real gloo runs."""
import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradsync
from gradsync.tools.launch import run_ranks
from helpers import assert_close_dicts, batches, mlp, params, shard

CAPS = dict(bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)  # several buckets, odd sizes: padding
K = 3  # micro-steps per window


def model(seed):
    return mlp(seed=seed, width=33, depth=5)


def optimizers(kind, ours, theirs):
    if kind == "sgd":
        return (gradsync.ShardedOptimizer(ours, torch.optim.SGD, lr=0.05, momentum=0.9),
                torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9))

    def groups(m):  # weight decay on matrices only: per-parameter options
        ps = list(m.module.parameters())
        return [{"params": [p for p in ps if p.dim() > 1], "weight_decay": 0.1},
                {"params": [p for p in ps if p.dim() <= 1], "weight_decay": 0.0}]
    return (gradsync.ShardedOptimizer(ours, torch.optim.AdamW, param_groups=groups(ours), lr=0.01),
            torch.optim.AdamW(groups(theirs), lr=0.01))


def micro_step(m, x, y, sync, how, *extra):
    """One micro-step's backward of ``m(x, *extra)``; ``how`` picks the way sync is switched off."""
    if sync or how == "sync_each_batch":
        (F.mse_loss(m(x, *extra), y) / K).backward()
    elif how == "require_backward_grad_sync":
        m.require_backward_grad_sync = False
        (F.mse_loss(m(x, *extra), y) / K).backward()
        m.require_backward_grad_sync = True
    else:
        with m.no_sync():
            (F.mse_loss(m(x, *extra), y) / K).backward()


def window(w, data, rank, world_size, runs, *extra):
    """The K micro-steps of window ``w`` on this rank's shards, the last one synced, for each
    (model, how) of ``runs`` in turn."""
    for m in range(K):
        x, y = data[w * K + m]
        xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
        for net, how in runs:
            micro_step(net, xs, ys, m == K - 1, how, *extra)


def against_torch(rank, world_size, kind, how, windows):
    ours = gradsync.ShardedDataParallel(model(seed=rank), **CAPS)  # ranks start apart: rank 0 wins
    theirs = nn.parallel.DistributedDataParallel(model(seed=rank))
    opt_a, opt_b = optimizers(kind, ours, theirs)
    sched_a, sched_b = (torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.7) for o in (opt_a, opt_b))
    data = batches(windows * K, world_size, per_rank=4)
    for w in range(windows):
        window(w, data, rank, world_size, [(ours, how), (theirs, "no_sync")])
        assert all(p.grad is None for p in ours.module.parameters())  # full-size grads released
        assert all(b.buffer is None for b in ours.reducer.buckets)  # staging buffers freed
        for opt, sched in ((opt_a, sched_a), (opt_b, sched_b)):
            opt.step()
            sched.step()
            opt.zero_grad()
    key = "momentum_buffer" if kind == "sgd" else "exp_avg"
    held = sum(s[key].numel() for s in opt_a.optimizer.state.values())
    biggest = max(b.numel for b in ours.reducer.buckets) * 4
    return (params(ours.module), params(theirs.module), held, opt_a.state_dict(), opt_b.state_dict(),
            ours.reducer.store.peak_staging_bytes, biggest, opt_a.param_groups[0]["lr"])


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("kind,how", [("sgd", "sync_each_batch"), ("sgd", "no_sync"),
                                      ("adamw", "sync_each_batch"), ("adamw", "require_backward_grad_sync")])
def test_matches_torch_ddp_with_the_same_optimizer(world_size, kind, how):
    windows = 3
    results = run_ranks(against_torch, world_size, kind, how, windows, timeout=90)
    total = sum(p.numel() for p in model(0).parameters())
    for ours, theirs, held, state_a, state_b, peak, biggest, lr in results:
        assert_close_dicts(ours, theirs, atol=1e-5)
        assert held <= math.ceil(total / world_size) + 8  # ~1/W of the state (+ padding)
        # the full state gathered from shards is torch's own format and values
        assert state_a["param_groups"] == [{**g, "initial_lr": g["initial_lr"]} for g in state_b["param_groups"]]
        assert state_a["state"].keys() == state_b["state"].keys()
        for j in state_b["state"]:
            assert_close_dicts(state_a["state"][j], state_b["state"][j], atol=1e-5)
        # each bucket in flight holds its staging buffer and the all-to-all's output (both bucket-sized on
        # CPU), plus the bucket being filled: not all buckets
        assert peak <= (2 * gradsync.sharded.wrapper.MAX_INFLIGHT + 1.5) * biggest
        assert lr == pytest.approx(0.01 * 0.7 ** windows if kind == "adamw" else 0.05 * 0.7 ** windows)
    assert sum(r[2] for r in results) == total  # the shards tile the state exactly
    for r in results[1:]:  # bit-for-bit agreement across ranks
        for name in r[0]:
            assert torch.equal(r[0][name], results[0][0][name]), name


GLOBAL = 8  # rows per global micro-batch: divisible by 1, 2 and 4


def checkpoint_run(rank, world_size, path, phase):
    ours = gradsync.ShardedDataParallel(model(seed=rank + 10), **CAPS)
    opt = gradsync.ShardedOptimizer(ours, torch.optim.AdamW, lr=0.01, weight_decay=0.1)
    data = batches(4 * K, 1, per_rank=GLOBAL)
    if phase == "load":
        ckpt = torch.load(path)
        ours.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optim"])
        assert_state_equal(opt.state_dict(), ckpt["optim"])
    for w in range(4) if phase == "save" else range(2, 4):
        if phase == "save" and w == 2:
            ckpt = {"model": ours.module.state_dict(), "optim": opt.state_dict()}
            if rank == 0:
                torch.save(ckpt, path)
        window(w, data, rank, world_size, [(ours, "no_sync")])
        opt.step()
        opt.zero_grad()
    return params(ours.module)


def assert_state_equal(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for j in a["state"]:
        assert_close_dicts(a["state"][j], b["state"][j], atol=0, rtol=0)


def test_checkpoint_moves_between_world_sizes(tmp_path):
    path = os.fspath(tmp_path / "ckpt.pt")
    final = run_ranks(checkpoint_run, 2, path, "save")[0]
    for world_size in (1, 4):
        for got in run_ranks(checkpoint_run, world_size, path, "load"):
            assert_close_dicts(got, final, atol=1e-5)


class Pair(nn.Module):
    """Two elements and a 0-dim one: at two ranks every piece of ``w`` holds one element."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w, self.s = nn.Parameter(torch.randn(2)), nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return x * self.w * self.s


def scalar_state(rank, world_size, cls, path, mode):
    """NAdam's mu_product and ASGD's eta and mu are one value per parameter, whatever its pieces hold."""
    ours, theirs = gradsync.ShardedDataParallel(Pair()), nn.parallel.DistributedDataParallel(Pair())
    opt_a, opt_b = gradsync.ShardedOptimizer(ours, cls, lr=0.01), cls(theirs.parameters(), lr=0.01)
    steps = range(2) if mode == "save" else range(2, 4)
    if mode == "load":
        ckpt = torch.load(path, weights_only=True)
        ours.load_state_dict(ckpt["model"])
        opt_a.load_state_dict(ckpt["ours"])
        theirs.load_state_dict(ckpt["model"])
        opt_b.load_state_dict(ckpt["ours"])  # torch's optimizer takes gradsync's checkpoint
    for step in steps:
        x = torch.randn(4, 2, generator=torch.Generator().manual_seed(10 * step + rank))
        for m, opt in ((ours, opt_a), (theirs, opt_b)):
            m(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
    state = opt_a.state_dict()  # a collective: every rank calls it once
    if mode == "save" and rank == 0:
        torch.save({"model": ours.state_dict(), "ours": state}, path)
    return state, opt_b.state_dict(), params(ours.module), params(theirs.module)


@pytest.mark.parametrize("cls", [torch.optim.NAdam, torch.optim.ASGD], ids=lambda c: c.__name__)
def test_scalar_optimizer_state_keeps_torchs_shape_and_moves_between_world_sizes(cls, tmp_path):
    path = os.fspath(tmp_path / "ckpt.pt")
    for world_size, mode in ((2, "save"), (1, "load"), (3, "load")):
        for ours, theirs, ours_params, theirs_params in run_ranks(scalar_state, world_size, cls, path, mode):
            for j in theirs["state"]:
                assert {k: getattr(v, "shape", None) for k, v in ours["state"][j].items()} == \
                    {k: getattr(v, "shape", None) for k, v in theirs["state"][j].items()}, (world_size, j)
            assert_close_dicts(ours_params, theirs_params, atol=1e-6)


def zeroed_by_the_model(rank, world_size, set_to_none):
    ours = gradsync.ShardedDataParallel(model(seed=0), **CAPS)
    theirs = nn.parallel.DistributedDataParallel(model(seed=0))
    opt_a, opt_b = optimizers("sgd", ours, theirs)
    for x, y in batches(3, world_size, per_rank=4):
        for m, opt in ((ours, opt_a), (theirs, opt_b)):
            F.mse_loss(m(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
            opt.step()
            m.zero_grad(set_to_none=set_to_none)  # the model's, not the optimizer's (the Hugging Face Trainer's habit)
    return params(ours.module), params(theirs.module)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_the_models_zero_grad_clears_the_shards(set_to_none):
    for ours, theirs in run_ranks(zeroed_by_the_model, 2, set_to_none):
        assert_close_dicts(ours, theirs)


def clipping(rank, world_size, how):
    ours = gradsync.ShardedDataParallel(model(seed=0), **CAPS)
    theirs = nn.parallel.DistributedDataParallel(model(seed=0))
    opt_a, opt_b = optimizers("sgd", ours, theirs)
    trace = ours.enable_comm_trace()
    data = batches(3 * K, world_size, per_rank=4)
    norms = []
    for w, norm_type in enumerate((2.0, float("inf"), 1.0)):
        window(w, data, rank, world_size, [(ours, how), (theirs, "no_sync")])
        ours.scale_grads_(1.5)  # what the accumulator calls; must reach the shards
        for p in theirs.parameters():
            p.grad.mul_(1.5)
        a = ours.clip_grad_norm_(0.05, norm_type=norm_type)
        b = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.05, norm_type=norm_type)
        norms.append((a.item(), b.item()))
        for opt in (opt_a, opt_b):
            opt.step()
            opt.zero_grad()
    synced = 3 * K if how == "sync_each_batch" else 3
    assert len(trace) == synced and all(b["launch"] <= b["done"] for it in trace for b in it["buckets"])
    assert sum(b["bytes"] for b in trace[0]["buckets"]) == 4 * sum(b.numel for b in ours.reducer.buckets)
    return norms, params(ours.module), params(theirs.module)


@pytest.mark.parametrize("how", ["sync_each_batch", "no_sync"])
def test_clip_grad_norm_is_global_across_shards(how):
    for norms, ours, theirs in run_ranks(clipping, 2, how):
        for a, b in norms:
            assert a == pytest.approx(b, rel=1e-5)
            assert a > 0.05  # the clip was active
        assert_close_dicts(ours, theirs, atol=1e-5)


class Branchy(nn.Module):
    """``never`` is unused on every rank; ``sometimes`` only on rank 0; ``wide`` is float64."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(8, 17)
        self.b = nn.Linear(17, 4)
        self.never = nn.Linear(17, 4)
        self.sometimes = nn.Linear(17, 4)
        self.wide = nn.Linear(17, 4).double()

    def forward(self, x, use):
        h = torch.tanh(self.a(x))
        out = self.b(h) + self.wide(h.double()).float()
        return out + self.sometimes(h) if use else out


def unused_and_mixed(rank, world_size, how):
    ours = gradsync.ShardedDataParallel(Branchy(rank), find_unused_parameters=True, **CAPS)
    theirs = nn.parallel.DistributedDataParallel(Branchy(rank), find_unused_parameters=True)
    opt_a = gradsync.ShardedOptimizer(ours, torch.optim.AdamW, lr=0.01, weight_decay=0.1)
    opt_b = torch.optim.AdamW(theirs.parameters(), lr=0.01, weight_decay=0.1)
    dtypes = {b.flat_param.dtype for b in ours.reducer.buckets}
    assert dtypes == {torch.float32, torch.float64}, dtypes
    data = batches(3 * K, world_size, per_rank=4)
    for w in range(3):
        window(w, data, rank, world_size, [(ours, how), (theirs, "no_sync")], rank == 0)
        for opt in (opt_a, opt_b):
            opt.step()
            opt.zero_grad()
    return params(ours.module), params(theirs.module), params(Branchy(0))


@pytest.mark.parametrize("world_size,how", [(2, "sync_each_batch"), (4, "no_sync")])
def test_unused_parameters_and_mixed_dtypes(world_size, how):
    for ours, theirs, initial in run_ranks(unused_and_mixed, world_size, how):
        assert_close_dicts(ours, theirs, atol=1e-5)
        for name in ("never.weight", "never.bias"):  # no gradient anywhere: not stepped, not decayed
            assert torch.equal(ours[name], initial[name])
        assert not torch.equal(ours["sometimes.weight"], initial["sometimes.weight"])
        assert ours["wide.weight"].dtype == torch.float64


def misuse(rank, world_size):
    errors = {}

    def expect(name, exc_type, fn):
        try:
            fn()
        except exc_type as exc:
            errors[name] = str(exc)

    ours = gradsync.ShardedDataParallel(model(0), **CAPS)
    opt = gradsync.ShardedOptimizer(ours, torch.optim.SGD, lr=0.1)
    expect("hook", NotImplementedError, lambda: ours.register_comm_hook(None, gradsync.allreduce_hook))
    expect("view", ValueError, lambda: gradsync.ShardedDataParallel(model(1), gradient_as_bucket_view=True))
    expect("plain", TypeError, lambda: gradsync.ShardedOptimizer(gradsync.DDP(model(2)), torch.optim.SGD, lr=1))
    expect("group", NotImplementedError, lambda: opt.add_param_group({"params": []}))
    x = torch.randn(4, 8)
    with ours.no_sync():
        ours(x).sum().backward()
    expect("pending", RuntimeError, opt.step)
    # a second optimizer's zero_grad would clear the first one's shards before it steps: refused while one lives
    halves = [{"params": [p for p in ours.module.parameters() if p.dim() > 1]},
              {"params": [p for p in ours.module.parameters() if p.dim() == 1]}]
    expect("second", NotImplementedError, lambda: gradsync.ShardedOptimizer(ours, torch.optim.SGD, lr=0.1,
                                                                             param_groups=halves[1:]))
    saved = opt.state_dict()
    opt.zero_grad()
    ours.module[0].weight.data = ours.module[0].weight.data.clone()  # detached from the flat buffer
    expect("moved", RuntimeError, opt.step)
    del opt  # gone: a new one may take the model over
    other = gradsync.ShardedOptimizer(ours, torch.optim.SGD, lr=0.1, param_groups=halves)
    expect("load", ValueError, lambda: other.load_state_dict(saved))
    return errors


def test_misuse_raises_clear_errors():
    errors = run_ranks(misuse, 2)[0]
    assert "comm" in errors["hook"] and "DistributedDataParallel" in errors["hook"]
    assert "gradient_as_bucket_view" in errors["view"]
    assert "ShardedDataParallel" in errors["plain"]
    assert "param_groups" in errors["group"]
    assert "no_sync" in errors["pending"]
    assert "parameter groups" in errors["load"]
    assert "flat buffers" in errors["moved"]
    assert "already has a ShardedOptimizer" in errors["second"] and "param_groups" in errors["second"]


def diverging(rank, world_size):
    ours = gradsync.ShardedDataParallel(model(0), timeout=3, **CAPS)
    opt = gradsync.ShardedOptimizer(ours, torch.optim.SGD, lr=0.1)
    ours(torch.randn(4, 8)).sum().backward()
    before = [p.detach().clone() for p in ours.module.parameters()]
    ctx = ours.no_sync() if rank == 1 else torch.enable_grad()  # rank 1 skips the sync: diverges
    try:
        with ctx:
            ours(torch.randn(4, 8)).sum().backward()
    except gradsync.SyncError:
        pass
    else:
        if rank == 0:
            raise AssertionError("rank 0 did not notice the divergence")
    try:
        opt.step()
    except RuntimeError as exc:
        stepped = str(exc)
    else:
        stepped = None
    return stepped, all(torch.equal(a, b) for a, b in zip(before, ours.module.parameters()))


def test_failed_sync_blocks_the_step():
    for stepped, unchanged in run_ranks(diverging, 2, timeout=30, pg_timeout=5):
        assert stepped is not None and ("incomplete" in stepped or "no_sync" in stepped), stepped
        assert unchanged


def sharded_join(rank, world_size):
    import torch.distributed.algorithms  # noqa: F401  (Join)
    model = gradsync.ShardedDataParallel(mlp(seed=0))
    with pytest.raises(NotImplementedError, match="does not support join"):
        with model.join():
            pass
    with pytest.raises(NotImplementedError, match="does not support join"):
        with torch.distributed.algorithms.Join([model]):
            pass
    with model.join(enable=False):  # torch's keywords, by position as in torch
        x, y = batches(1, world_size)[0]
        micro_step(model, shard(x, rank, world_size), shard(y, rank, world_size), True, "no_sync")


def test_join_on_a_sharded_model_raises_clearly():
    run_ranks(sharded_join, 2)


def torch_clip(rank, world_size):
    ours = gradsync.ShardedDataParallel(model(seed=0), **CAPS)
    twin = gradsync.ShardedDataParallel(model(seed=0), **CAPS)
    theirs = nn.parallel.DistributedDataParallel(model(seed=0))
    data = batches(K, world_size, per_rank=4)
    window(0, data, rank, world_size, [(ours, "no_sync"), (twin, "no_sync"), (theirs, "no_sync")])
    a = torch.nn.utils.clip_grad_norm_(ours.parameters(), 0.05)  # torch's function on the shards
    b = twin.clip_grad_norm_(0.05)
    c = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.05)  # not sharded: torch's own
    assert a.item() == b.item() and a.item() == pytest.approx(c.item(), rel=1e-5) and a.item() > 0.05
    for x, y in zip(ours.reducer.buckets, twin.reducer.buckets):
        assert torch.equal(x.grad_shard, y.grad_shard)
    with pytest.raises(RuntimeError, match="some, not all.*model.clip_grad_norm_"):
        torch.nn.utils.clip_grad_norm_(list(ours.parameters())[:2], 0.05)
    with ours.no_sync():
        (F.mse_loss(ours(shard(data[0][0], rank, world_size)), shard(data[0][1], rank, world_size))).backward()
    with pytest.raises(RuntimeError, match="no_sync"):  # local gradients are not the window's gradient
        torch.nn.utils.clip_grad_norm_(ours.parameters(), 0.05)


def test_torch_clip_grad_norm_clips_the_shards():
    run_ranks(torch_clip, 2)


def clip_by_value(rank, world_size):
    ours = gradsync.ShardedDataParallel(model(seed=0), **CAPS)
    twin = gradsync.ShardedDataParallel(model(seed=0), **CAPS)
    theirs = nn.parallel.DistributedDataParallel(model(seed=0))
    opts = [gradsync.ShardedOptimizer(ours, torch.optim.AdamW, lr=0.01),
            gradsync.ShardedOptimizer(twin, torch.optim.AdamW, lr=0.01), torch.optim.AdamW(theirs.parameters(), lr=0.01)]
    data = batches(2 * K, world_size, per_rank=4)
    for w in range(2):
        window(w, data, rank, world_size, [(ours, "no_sync"), (twin, "no_sync"), (theirs, "no_sync")])
        assert max(p.grad.abs().max().item() for p in theirs.parameters()) > 0.01  # the clamp is active
        torch.nn.utils.clip_grad_value_(ours.parameters(), 0.01)  # torch's function on the shards
        twin.clip_grad_value_(0.01)
        torch.nn.utils.clip_grad.clip_grad_value_(theirs.parameters(), 0.01)  # not sharded: torch's own
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert_close_dicts(params(ours.module), params(theirs.module))
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), twin.parameters()))
    with pytest.raises(RuntimeError, match="some, not all.*model.clip_grad_value_"):
        torch.nn.utils.clip_grad_value_(list(ours.parameters())[:2], 0.01)


def test_torch_clip_grad_value_clamps_the_shards():
    """A sharded model's .grad is None after a synced backward: torch's function alone would clamp nothing."""
    run_ranks(clip_by_value, 2)


def refuse_alone(rank, world_size):
    """Only rank 0 constructs: a refusal that came after the construction's first collective would
    meet no peer and end in a SyncError after ``timeout`` instead."""
    if rank != 0:
        return None
    found = {}
    for name, opts in (("view", dict(gradient_as_bucket_view=True)), ("auto", dict(bucket_cap_mb="auto")),
                       ("finite", dict(check_finite=True))):
        try:
            gradsync.ShardedDataParallel(model(0), timeout=3, **opts)
        except Exception as exc:  # noqa: BLE001 - the type is what the test checks
            found[name] = (type(exc).__name__, str(exc))
    return found


def test_refusals_come_before_any_collective():
    found = run_ranks(refuse_alone, 2)[0]
    assert {name: kind for name, (kind, _) in found.items()} == {"view": "ValueError", "auto": "ValueError",
                                                                  "finite": "ValueError"}, found
    assert "gradient_as_bucket_view" in found["view"][1] and "check_finite" in found["finite"][1]
