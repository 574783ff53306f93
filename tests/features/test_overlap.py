"""overlap_optimizer: the optimizer steps bucket by bucket inside the synced backward."""
import pytest
import torch
import torch.nn.functional as F

import gradsync
from gradsync.tools.launch import run_ranks
from helpers import TIMEOUT, batches, faults, micro_steps, mlp, outcome, shard, shard_backward

SMALL_BUCKETS = dict(bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005)  # several buckets per step

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "adam_groups": lambda ps: torch.optim.Adam([{"params": ps[:2], "lr": 0.02}, {"params": ps[2:]}], lr=0.01),
}


def train(rank, world_size, make_opt, overlapped, view):
    model = gradsync.DDP(mlp(seed=0), gradient_as_bucket_view=view, **SMALL_BUCKETS)
    opt = OPTIMIZERS[make_opt](list(model.parameters()))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # hyperparameters change per step
    if overlapped:
        gradsync.overlap_optimizer(model, opt)
    for x, y in batches(4, world_size):
        shard_backward(model, rank, world_size, x, y)
        opt.step()
        sched.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}, len(model.reducer.buckets)


@pytest.mark.parametrize("view", [False, True], ids=["copy", "view"])
@pytest.mark.parametrize("make_opt", list(OPTIMIZERS))
def test_parameters_are_bit_identical_to_the_plain_loop(make_opt, view):
    plain = run_ranks(train, 2, make_opt, False, view)
    overlapped = run_ranks(train, 2, make_opt, True, view)
    assert plain[0][1] >= 3  # several buckets, so the step really is split
    for (ours, _), (theirs, _) in zip(overlapped, plain):
        for name in theirs:
            assert torch.equal(ours[name], theirs[name]), name
    assert all(torch.equal(overlapped[0][0][n], overlapped[1][0][n]) for n in overlapped[0][0])


def wrapped_again(rank, world_size, overlap_again):
    """The module wrapped again halfway (after unfreezing a layer, a new stage) with the same optimizer: overlapped
    anew, or stepped after backward; the old handle goes with the old wrapper."""
    out = []
    for overlapped in (True, False):
        module = mlp(seed=0)
        opt = torch.optim.AdamW(module.parameters(), lr=0.01)
        model = gradsync.DDP(module, **SMALL_BUCKETS)
        if overlapped:
            gradsync.overlap_optimizer(model, opt)
        for k, (x, y) in enumerate(batches(4, world_size)):
            if k == 2 and overlapped:
                model = gradsync.DDP(module, **SMALL_BUCKETS)
                if overlap_again:
                    gradsync.overlap_optimizer(model, opt)
            shard_backward(model, rank, world_size, x, y)
            opt.step()
            opt.zero_grad()
        out.append({n: p.detach().clone() for n, p in module.named_parameters()})
    return out


@pytest.mark.parametrize("overlap_again", [True, False])
def test_a_module_wrapped_again_steps_as_the_plain_loop(overlap_again):
    for ours, plain in run_ranks(wrapped_again, 2, overlap_again):
        for name in plain:
            assert torch.equal(ours[name], plain[name]), name


def windows(rank, world_size, overlapped, sync_each_batch=False):
    model = gradsync.DDP(mlp(seed=0), **SMALL_BUCKETS)
    acc = gradsync.GradientAccumulator(model, steps=3, sync_each_batch=sync_each_batch)
    opt = acc.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    if overlapped:
        gradsync.overlap_optimizer(model, opt)  # the accumulator's wrapper, unwrapped
    for _ in micro_steps(model, acc, opt, rank, world_size, batches(9, world_size)):
        pass
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}


@pytest.mark.parametrize("sync_each_batch", [False, True])
def test_accumulation_windows_step_only_at_the_window_end(sync_each_batch):
    """With sync_each_batch every micro-step syncs, and the buckets still step only in the window's last one (they
    stepped in every synced backward before: an optimizer step per micro-step)."""
    ours, theirs = run_ranks(windows, 2, True, sync_each_batch), run_ranks(windows, 2, False, sync_each_batch)
    for mine, plain in zip(ours, theirs):
        assert all(torch.equal(mine[n], plain[n]) for n in plain)


def item_windows(rank, world_size, overlapped, view):
    """AdamW over windows of 3 micro-steps whose losses are sums over an uneven number of rows (num_items)."""
    model = gradsync.DDP(mlp(seed=0), gradient_as_bucket_view=view, **SMALL_BUCKETS)
    acc = gradsync.GradientAccumulator(model, steps=3)
    opt = acc.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    if overlapped:
        gradsync.overlap_optimizer(model, opt)
    for k, (x, y) in enumerate(acc.iterate(batches(9, world_size))):
        n = 1 + (k + 2 * rank) % 3
        with acc.accumulate():
            out = model(shard(x, rank, world_size))[:n]
            acc.backward(F.mse_loss(out, shard(y, rank, world_size)[:n], reduction="sum"), num_items=n)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}


@pytest.mark.parametrize("view", [False, True], ids=["copy", "view"])
def test_num_items_rescales_each_bucket_before_it_steps(view):
    """The window's factor (world size / items on every rank) is known once the synced backward's header is in:
    each bucket is rescaled before it steps, and the parameters equal the plain loop's bit for bit."""
    for ours, theirs in zip(run_ranks(item_windows, 2, True, view), run_ranks(item_windows, 2, False, view)):
        assert all(torch.equal(ours[n], theirs[n]) for n in theirs)


def gated(rank, world_size):
    """The last bucket's future completes only when bucket 0's parameters have been stepped."""
    model = gradsync.DDP(mlp(seed=0), **SMALL_BUCKETS)
    last = len(model.reducer.buckets) - 1
    gate = torch.futures.Future()

    @gradsync.hooks.one_collective
    def hook(state, bucket):
        fut = gradsync.allreduce_hook(None, bucket)
        if bucket.index() != last:
            return fut
        return gate.then(lambda _: fut.wait())  # fut: already launched in bucket order

    model.register_comm_hook(None, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = gradsync.overlap_optimizer(model, opt)
    seen = []
    first = set(model.reducer.buckets[0].members)
    plain_bucket_step = handle._step_bucket

    def observe(members):
        plain_bucket_step(members)
        seen.append((tuple(members), gate.done()))
        if set(members) == first:
            gate.set_result(None)  # only now may the last bucket finish
    model.reducer.on_bucket_reduced(observe)
    x, y = batches(1, world_size)[0]
    shard_backward(model, rank, world_size, x, y)
    opt.step()
    return seen, last


def test_a_bucket_steps_while_later_buckets_are_in_flight():
    for seen, last in run_ranks(gated, 2):
        assert len(seen) == last + 1
        assert seen[0][1] is False  # bucket 0 stepped before the last bucket's reduction finished


def misuse(rank, world_size, how):
    kw = {"find_unused_parameters": True} if how == "find_unused" else {}
    model = gradsync.DDP(mlp(seed=0), timeout=TIMEOUT, **kw)
    x, y = batches(1, world_size)[0]

    def run():
        if how == "lbfgs":
            gradsync.overlap_optimizer(model, torch.optim.LBFGS(model.parameters()))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if how == "foreign":
            opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
        gradsync.overlap_optimizer(model, opt)
        if how == "foreign_later":  # found before the first bucket of the next synced backward steps
            opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
        if how == "step_without_backward":
            opt.step()
        shard_backward(model, rank, world_size, x, y)
        if how == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if how == "clip_value":
            torch.nn.utils.clip_grad_value_(model.parameters(), 1.0)
        if how == "closure":
            opt.step(lambda: 0.0)
        if how == "two_backwards":  # two losses (or a GAN's generator loss through the discriminator), one step
            shard_backward(model, rank, world_size, x, y)
    return outcome(run)


@pytest.mark.parametrize("how, error, words", [
    ("lbfgs", "TypeError", "cannot split LBFGS.step() per bucket"),
    ("find_unused", "ValueError", "find_unused_parameters=False"),
    ("foreign", "ValueError", "that the model does not reduce"),
    ("foreign_later", "ValueError", "that the model does not reduce"),
    ("step_without_backward", "RuntimeError", "without a synced backward since the last step"),
    ("clip", "RuntimeError", "clip_grad_norm_ after a backward"),
    ("clip_value", "RuntimeError", "clip_grad_value_ after a backward"),
    ("closure", "RuntimeError", "step(closure) cannot re-run it"),
    ("two_backwards", "RuntimeError", "a second synced backward before optimizer.step()"),
])
def test_what_cannot_be_split_per_bucket_raises(how, error, words):
    for kind, message, _ in faults(misuse, how):
        assert kind == error and words in message, (kind, message)


def scaled(rank, world_size, wrapped):
    model = gradsync.DDP(mlp(seed=0), timeout=TIMEOUT)
    acc = gradsync.GradientAccumulator(model, steps=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=wrapped)  # a fused one scales itself: its claim returns
    stepper = acc.wrap_optimizer(opt) if wrapped else opt
    handle = gradsync.overlap_optimizer(model, stepper)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    x, y = batches(1, world_size)[0]

    def step():
        with acc.accumulate():
            loss = scaler.scale(F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)))
            acc.backward(loss) if wrapped else loss.backward()
        scaler.step(stepper)
    refused = outcome(step)
    handle.remove()
    return refused[:2], opt.__dict__.get("_step_supports_amp_scaling")


@pytest.mark.parametrize("wrapped", [False, True], ids=["optimizer", "accumulators_fused_optimizer"])
def test_a_grad_scaler_is_refused_at_its_first_step(wrapped):
    """The buckets stepped on scaled gradients before the scaler could unscale them or skip: every rank raises at
    scaler.step (it calls step() every time, even on an inf); remove() hands the optimizer back to torch's scaler."""
    for (kind, message), claimed in run_ranks(scaled, 2, wrapped):
        assert kind == "RuntimeError" and "cannot serve a GradScaler" in message, (kind, message)
        assert claimed is (True if wrapped else None)  # what the optimizer held before


def sharded(rank, world_size):
    model = gradsync.ShardedDataParallel(mlp(seed=0))
    return outcome(lambda: gradsync.overlap_optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1)))


def test_sharded_models_are_refused():
    for kind, message, _ in run_ranks(sharded, 2):
        assert kind == "TypeError" and "ShardedOptimizer already steps" in message


def clip_with_a_sharded_model(rank, world_size, sharded_first):
    if sharded_first:
        sharded = gradsync.ShardedDataParallel(mlp(seed=1))
    model = gradsync.DDP(mlp(seed=0))
    gradsync.overlap_optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    if not sharded_first:
        sharded = gradsync.ShardedDataParallel(mlp(seed=1))
    x, y = batches(1, world_size)[0]
    shard_backward(model, rank, world_size, x, y)
    refused = outcome(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    shard_backward(sharded, rank, world_size, x, y)
    norm = torch.nn.utils.clip_grad.clip_grad_norm_(sharded.parameters(), 1e-3)  # .grad is None: the shards'
    return refused[:2], norm.item()


@pytest.mark.parametrize("sharded_first", [True, False], ids=["sharded_first", "overlap_first"])
def test_clip_check_and_sharded_clipping_hold_in_either_order(sharded_first):
    for (kind, message), norm in run_ranks(clip_with_a_sharded_model, 2, sharded_first):
        assert kind == "RuntimeError" and "clip_grad_norm_ after a backward" in message, (kind, message)
        assert norm > 1e-3


def deleted(rank, world_size):
    import gc
    import weakref
    model = gradsync.DDP(mlp(seed=0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gradsync.overlap_optimizer(model, opt)
    shard_backward(model, rank, world_size, *batches(1, world_size)[0])
    opt.step()
    refs = [weakref.ref(model), weakref.ref(opt)]
    del model, opt
    gc.collect()
    return [r() is None for r in refs]


def test_a_deleted_model_and_its_optimizer_are_freed():
    assert run_ranks(deleted, 1) == [[True, True]]


def changed_later(rank, world_size, how, overlapped):
    """What a loop may do after overlap_optimizer: build its scheduler, add a parameter group, or train a
    static_graph model with a parameter no forward uses."""
    module = mlp(seed=0)
    if how == "static_graph_unused":
        module.register_parameter("never", torch.nn.Parameter(torch.ones(3)))
    model = gradsync.DDP(module, static_graph=how == "static_graph_unused", **SMALL_BUCKETS)
    ps = list(model.parameters())
    opt = torch.optim.AdamW(ps[:2] if how == "add_param_group" else ps, lr=0.01)
    if overlapped:
        gradsync.overlap_optimizer(model, opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # built after it
    for step, (x, y) in enumerate(batches(4, world_size)):
        if how == "add_param_group" and step == 1:
            opt.add_param_group({"params": ps[2:], "lr": 0.02})
        shard_backward(model, rank, world_size, x, y)
        opt.step()
        sched.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}


@pytest.mark.parametrize("how", ["scheduler_after", "add_param_group", "static_graph_unused"])
def test_later_changes_step_as_the_plain_loop(how):
    # a scheduler built after it re-binds optimizer.step to the optimizer; a group added later was never
    # stepped; static_graph's unused parameter got a zero gradient and AdamW moved it
    plain, overlapped = run_ranks(changed_later, 2, how, False), run_ranks(changed_later, 2, how, True)
    for ours, theirs in zip(overlapped, plain):
        for name in theirs:
            assert torch.equal(ours[name], theirs[name]), name
