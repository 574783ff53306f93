"""Skipped micro-steps (issue 25): one rank's OOM, NaN loss or bad batch costs that micro-step only.

Each run follows a plan of faults, injected for real on one rank at one micro-step: an exception
raised in forward, one raised in the middle of backward (after later layers' gradients were
accumulated), a NaN loss, ``acc.skip()``. Every rank's parameters are compared with one process
trained on exactly the micro-batches that ran, and the ranks with each other, bit for bit.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradsync
from gradsync.tools.launch import compile_before_forking, run_ranks
from helpers import assert_close_dicts, batches, faults, params, shard

STEPS, WINDOWS, ROWS = 3, 3, 4
OOM = torch.OutOfMemoryError


class FailInBackward(torch.autograd.Function):
    """Identity; its backward raises, after the layers behind it got their gradients."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise OOM("injected: out of memory in backward")


class Faulty(nn.Module):
    def __init__(self, buffers=False):
        super().__init__()
        torch.manual_seed(0)
        self.lin1, self.lin2, self.lin3 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.norm = nn.BatchNorm1d(16) if buffers else nn.Identity()  # buffers: a broadcast every forward
        self.fault = None

    def forward(self, x):
        if self.fault == "forward":
            raise OOM("injected: out of memory in forward")
        h = torch.tanh(self.norm(self.lin1(x)))
        if self.fault == "backward":
            h = FailInBackward.apply(h)
        return self.lin3(torch.tanh(self.lin2(h)))


def counts(k, rank):
    return 1 + (3 * k + rank) % ROWS  # items per micro-batch and rank: uneven, never zero


# (window, micro-step, rank) -> fault; window 2: rank 0 skips it all
MIXED = {(0, 0, 1): "forward", (0, 1, 1): "nan", (1, 1, 0): "backward", (1, 2, 1): "skip",
         (2, 0, 0): "skip", (2, 1, 0): "forward", (2, 2, 0): "skip"}
EVERY_RANK_SKIPS_WINDOW_1 = {(1, i, r): "skip" for i in range(STEPS) for r in range(3)}


def micro_batches(world_size):
    return batches(WINDOWS * STEPS, world_size, per_rank=ROWS)


def train(rank, world_size, plan, mode, buffers=False, options=None):
    opts = dict(options or {})
    wrap, sync_each_batch, overlap = opts.pop("wrap", "ddp"), opts.pop("sync_each_batch", False), opts.pop("overlap", False)
    hook, compiled = opts.pop("hook", None), opts.pop("compile", False)
    net = Faulty(buffers)
    spare = opts.pop("spare", False)
    if spare:  # a parameter no rank uses, larger than a bucket: skip_all_reduce_unused_params skips its bucket
        net.register_parameter("spare", nn.Parameter(torch.zeros(300)))
    if opts.pop("delay", False):  # lin3's all-reduce runs after the backward, outside the buckets
        opts["delay_all_reduce_named_params"] = [(n, p) for n, p in net.named_parameters() if n.startswith("lin3")]
        opts["param_to_hook_all_reduce"] = net.lin1.weight  # its gradient comes last: the delayed one starts there
    if wrap == "sharded":
        model = gradsync.ShardedDataParallel(net, bucket_cap_mb=0.001, **opts)
        opt = gradsync.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
    else:
        model = gradsync.DDP(net, **{"bucket_cap_mb": 0.001, **opts})
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if overlap:  # each bucket steps inside the synced backward, rescaled first
            gradsync.overlap_optimizer(model, opt)
        if hook == "powersgd":  # a hook with state; process_group=None: the model's default group
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
            state = powersgd.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2, random_seed=0)
            model.register_comm_hook(state, powersgd.powerSGD_hook)
        elif hook is not None:
            model.register_comm_hook(None, hook)
    acc = gradsync.GradientAccumulator(model, steps=STEPS, sync_each_batch=sync_each_batch,
                                       skip_on=(OOM,), skip_nonfinite=True)
    opt = acc.wrap_optimizer(opt)
    skipped, empty = [], []
    forward = torch.compile(model) if compiled else model
    for k, fault, x, y in planned_micro_steps(acc, plan, rank, world_size):
        n = counts(k, rank)
        faulty_micro_step(acc, forward, net, x, fault, lambda out: (F.mse_loss(out, y),) if mode == "mean"
                          else (F.mse_loss(out[:n], y[:n], reduction="sum"), n))
        opt.step()
        opt.zero_grad()
        if acc.is_boundary:
            skipped.append(list(acc.skipped))
            empty.append(acc.window_empty)
    if spare:  # the last synced backward launched no collective for the spare's bucket, which never stepped
        assert model.reducer.skips.reduced == len(model.reducer.buckets) - 1, model.reducer.skips.reduced
        assert torch.equal(net.spare, torch.zeros(300))
        del net.spare
    return params(net), skipped, empty


def run_ranks_for(fn, world_size, plan, mode, buffers, options):
    """``run_ranks``; with torch.compile, inductor warmed here first and every wait bounded by minutes: a rank
    whose injected fault changes the module's attributes recompiles alone (Dynamo guards on them) while the others
    wait in the next collective, and under load that compile outlasted the default 20 s."""
    if not options.get("compile"):
        return run_ranks(fn, world_size, plan, mode, buffers, options)
    compile_before_forking("inductor")
    return run_ranks(fn, world_size, plan, mode, buffers, {**options, "timeout": 240}, timeout=400, pg_timeout=240)


def planned_micro_steps(acc, plan, rank, world_size):
    """Yield (index, this rank's fault or None, x, y) for every micro-step, through ``acc.iterate``."""
    for k, (x, y) in enumerate(acc.iterate(micro_batches(world_size))):
        yield k, plan.get((*divmod(k, STEPS), rank)), shard(x, rank, world_size), shard(y, rank, world_size)


def faulty_micro_step(acc, model, net, x, fault, loss_of):
    """One micro-step with ``fault`` injected for real; ``loss_of(output)`` gives acc.backward's arguments."""
    with acc.accumulate():
        if fault == "skip":
            acc.skip("empty batch")
        net.fault = fault
        try:
            acc.backward(*loss_of(model(x * float("nan") if fault == "nan" else x)))
        finally:
            net.fault = None


def kept(plan, world_size):
    """Per window, the (micro-step, rank) pairs whose gradient the window keeps."""
    windows = []
    for w in range(WINDOWS):
        ran = {(i, r) for i in range(STEPS) for r in range(world_size) if (w, i, r) not in plan}
        for (pw, i, r), fault in plan.items():
            if pw == w and fault == "backward":  # a failed backward drops that rank's window so far
                ran -= {(j, r) for j in range(i)}
        windows.append(sorted(ran))
    return windows


def reference(plan, mode, world_size, buffers=False):
    net = Faulty(buffers)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    data = micro_batches(world_size)
    for w, ran in enumerate(kept(plan, world_size)):
        if not ran:
            continue
        losses, total = [], 0
        for i, r in ran:
            k = w * STEPS + i
            x, y = shard(data[k][0], r, world_size), shard(data[k][1], r, world_size)
            if mode == "mean":
                losses.append(F.mse_loss(net(x), y))
            else:
                n = counts(k, r)
                losses.append(F.mse_loss(net(x)[:n], y[:n], reduction="sum"))
                total += n
        (sum(losses) / (len(ran) if mode == "mean" else total)).backward()
        opt.step()
        opt.zero_grad()
    return params(net)


def check(results, plan, mode, world_size, buffers=False, atol=None):
    want = reference(plan, mode, world_size, buffers)
    first_params, first_skipped, _ = results[0]
    for got, skipped, _ in results:
        assert_close_dicts(got, first_params, atol=0, rtol=0)  # ranks bit-identical
        assert skipped == first_skipped  # acc.skipped is the same on every rank
    assert_close_dicts(first_params, want, **({} if atol is None else {"atol": atol, "rtol": atol}))
    for w, records in enumerate(first_skipped):
        faulted = {(r, i) for (pw, i, r) in plan if pw == w}
        assert faulted <= {(r, i) for r, i, _ in records}, (w, records)


@pytest.mark.parametrize("world_size,mode,buffers", [(2, "mean", False), (2, "items", True),
                                                     (3, "mean", True), (3, "items", False)])
def test_every_kind_of_skip_is_exact(world_size, mode, buffers):
    plan = {key: f for key, f in MIXED.items() if key[2] < world_size}
    check(run_ranks(train, world_size, plan, mode, buffers), plan, mode, world_size, buffers)


def test_reasons_name_the_fault_and_the_dropped_micro_steps():
    plan = dict(MIXED)
    _, skipped, _ = run_ranks(train, 2, plan, "mean")[0]
    w0, w1 = skipped[0], skipped[1]
    assert (1, 0, "OutOfMemoryError: injected: out of memory in forward") in w0
    assert any(r == 1 and i == 1 and reason.startswith("non-finite loss") for r, i, reason in w0)
    assert (0, 1, "OutOfMemoryError: injected: out of memory in backward") in w1
    assert (0, 0, "dropped with micro-step 1: its backward failed part-way") in w1  # its partial gradients
    assert (1, 2, "empty batch") in w1


@pytest.mark.parametrize("mode", ["mean", "items"])
def test_every_rank_skipping_a_window_steps_nothing_and_warns(mode):
    plan = {key: f for key, f in EVERY_RANK_SKIPS_WINDOW_1.items() if key[2] < 2}
    results = run_ranks(train, 2, plan, mode)
    check(results, plan, mode, 2)
    assert [empty for _, _, empty in results] == [[False, True, False]] * 2


SYNCED = {key: f for key, f in MIXED.items() if f != "backward"}  # no backward fails while it syncs


@pytest.mark.parametrize("how", ["sync_each_batch", "sharded", "reduce_dtype", "find_unused_parameters",
                                 "skip_all_reduce_unused_params", "views",
                                 "static_graph", "overlap_optimizer", "auto", "bf16_hook",
                                 "delay_all_reduce_named_params", "deterministic", "torch_compile", "powersgd"])
def test_skips_combine_with_other_modes(how):
    opts = {"sync_each_batch": dict(sync_each_batch=True), "sharded": dict(wrap="sharded"),
            "static_graph": dict(static_graph=True), "overlap_optimizer": dict(overlap=True),
            "auto": dict(bucket_cap_mb="auto"), "bf16_hook": dict(hook=gradsync.bf16_compress_hook),
            "delay_all_reduce_named_params": dict(delay=True), "deterministic": dict(deterministic=True),
            "torch_compile": dict(compile=True), "powersgd": dict(hook="powersgd"),
            "reduce_dtype": dict(reduce_dtype=torch.float32), "views": dict(gradient_as_bucket_view=True),
            "find_unused_parameters": dict(find_unused_parameters=True),
            "skip_all_reduce_unused_params": SKIP_UNUSED}[how]
    plan = {key: f for key, f in (SYNCED if how == "sync_each_batch" else MIXED).items() if key[2] < 2}
    # the bf16 hook rounds each reduced bucket to bf16 on the wire; PowerSGD's rank-1 windows only train alike
    bf16 = {"bf16_hook": 5e-3, "powersgd": 0.05}.get(how)
    check(run_ranks_for(train, 2, plan, "items", False, opts), plan, "items", 2, atol=bf16)


SKIP_UNUSED = dict(find_unused_parameters=True, skip_all_reduce_unused_params=True, spare=True,
                   bucket_cap_mb=5e-4, first_bucket_cap_mb=5e-4)  # the spare in a bucket of its own


# a backward failing part-way in the window's synced micro-step: every rank reduces again without its window
SYNC_FAILS = {(0, 2, 0): "backward", (1, 2, 1): "backward", (1, 0, 0): "nan", (2, 1, 0): "skip"}


@pytest.mark.parametrize("world_size,mode,options", [
    (2, "mean", {}), (3, "items", {}), (2, "items", {"gradient_as_bucket_view": True}),
    (3, "mean", {"reduce_dtype": torch.float32}),
    (2, "mean", {"reduce_dtype": torch.float32, "gradient_as_bucket_view": True}),
    (3, "items", {"static_graph": True}), (3, "mean", {"overlap": True}),
    (2, "items", {"overlap": True, "gradient_as_bucket_view": True}), (3, "mean", {"find_unused_parameters": True}),
    (2, "items", {"bucket_cap_mb": "auto"}), (3, "mean", {"hook": gradsync.bf16_compress_hook}),
    (3, "items", {"delay": True}), (3, "mean", {"deterministic": True}), (2, "mean", {"compile": True}),
    (2, "mean", {"wrap": "sharded"}), (3, "items", {"wrap": "sharded"}), (3, "mean", SKIP_UNUSED),
    (2, "items", {"wrap": "sharded", "reduce_dtype": torch.float32})])
def test_a_backward_failing_while_it_syncs_is_reduced_again_without_its_window(world_size, mode, options):
    """With gradient views or reduce_dtype the window lives in the buckets: skip_on makes each bucket reduce
    a copy (keep_window_apart), so the window survives to be reduced again."""
    plan = {key: f for key, f in SYNC_FAILS.items() if key[2] < world_size}
    results = run_ranks_for(train, world_size, plan, mode, False, options)
    check(results, plan, mode, world_size, atol=5e-3 if "hook" in options else None)
    assert any(reason.startswith("dropped") for _, _, reason in results[0][1][0])


def test_a_stateful_hook_is_rewound_when_a_synced_backward_fails():
    """torch's PowerSGD keeps a step count, error feedback, warm starts and a random state, which the failed
    reduction's buckets advanced on every rank: each rank rewinds it before reducing again without the failed
    rank's window (engine/launcher.py). So the run is bit-identical to the one where that rank skipped the window's
    micro-steps instead (PowerSGD is lossy: one process on the kept micro-batches is no reference; window 2 is the
    first it compresses)."""
    fails = {(2, STEPS - 1, 1): "backward"}
    skips = {(2, i, 1): "skip" for i in range(STEPS)}
    failed, skipped = (run_ranks(train, 3, plan, "mean", False, {"hook": "powersgd"}) for plan in (fails, skips))
    for (a, _, _), (b, _, _) in zip(failed, skipped):
        assert_close_dicts(a, b, atol=0, rtol=0)
    assert_close_dicts(failed[0][0], reference(fails, "mean", 3, False), atol=0.05, rtol=0.05)  # and it trains


def fails_while_syncing(rank, world_size, options, plan):
    from helpers import outcome
    return outcome(lambda: train(rank, world_size, plan, "mean", False, {"timeout": 60, **options}))


@pytest.mark.parametrize("options", [{"sync_each_batch": True}])
@pytest.mark.parametrize("plan", [{(0, 2, 0): "backward"},
                                  # its own micro-steps skipped: the window still holds the other's synced ones
                                  {(0, 0, 0): "forward", (0, 1, 0): "skip", (0, 2, 0): "backward"}])
def test_a_failed_synced_backward_that_cannot_be_redone_raises_on_every_rank_at_once(options, plan):
    # the failed rank flags itself in the control: no rank waits for the 60 s timeout
    for kind, message, seconds in faults(fails_while_syncing, options, plan):
        assert kind == "SyncError" and "failed part-way" in message and "zero_grad" in message, message
        assert seconds < 30


@pytest.mark.parametrize("mode", ["mean", "items"])
def test_overlap_optimizer_steps_a_window_every_rank_skipped_nowhere(mode):
    """overlap_optimizer steps each bucket inside the synced backward: a window that ran on no rank must not step
    (its factor is None), and the next one steps as usual."""
    plan = {key: f for key, f in EVERY_RANK_SKIPS_WINDOW_1.items() if key[2] < 2}
    results = run_ranks(train, 2, plan, mode, False, {"overlap": True})
    check(results, plan, mode, 2)
    assert [empty for _, _, empty in results] == [[False, True, False]] * 2


def test_skip_on_refuses_what_must_never_be_skipped():
    net = Faulty()
    for bad in (Exception, RuntimeError, gradsync.SyncError, KeyboardInterrupt, "oom"):
        with pytest.raises((TypeError, ValueError), match="skip_on"):
            gradsync.GradientAccumulator(net, steps=2, skip_on=(bad,))
    acc = gradsync.GradientAccumulator(net, steps=2, skip_on=(OOM,))
    with pytest.raises(RuntimeError, match="inside"):
        acc.skip()
    with acc.accumulate():
        acc.backward(net(torch.randn(2, 8)).sum())
        with pytest.raises(RuntimeError, match="after acc.backward"):
            acc.skip()


# static_graph learns its graph from the first synced backward: a rank skips that one, fails in a later one
STATIC = {(0, 2, 1): "forward", (1, 2, 0): "backward", (2, 0, 1): "backward", (2, 2, 0): "nan"}


@pytest.mark.parametrize("world_size,mode", [(2, "mean"), (3, "items")])
def test_static_graph_skips_its_first_synced_backward_and_fails_in_a_later_one(world_size, mode):
    plan = {key: f for key, f in STATIC.items() if key[2] < world_size}
    check(run_ranks(train, world_size, plan, mode, False, {"static_graph": True}), plan, mode, world_size)


def with_grad_scaler(rank, world_size, scaled):
    net = Faulty()
    model = gradsync.DDP(net)
    acc = gradsync.GradientAccumulator(model, steps=STEPS, skip_on=(OOM,), skip_nonfinite=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4) if scaled else None
    plan = {(0, 1, 1): "nan", (1, 2, 0): "skip"}
    for _, fault, x, y in planned_micro_steps(acc, plan, rank, world_size):
        faulty_micro_step(acc, model, net, x, fault,
                          lambda out: (scaler.scale(F.mse_loss(out, y)) if scaled else F.mse_loss(out, y),))
        if acc.is_boundary:  # the scaler unscales and checks the reduced window, once per window
            if scaled:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad()
    return params(net)


def test_grad_scaler_steps_the_window_the_skips_left():
    # a power-of-two scale is exact: scaled and unscaled training agree bit for bit
    scaled, plain = run_ranks(with_grad_scaler, 2, True), run_ranks(with_grad_scaler, 2, False)
    for a, b in zip(scaled, plain):
        assert_close_dicts(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("mode", ["mean", "items"])
def test_the_window_rescale_reaches_delay_all_reduce_named_params(mode):
    """Parameters averaged apart from the buckets (delay_all_reduce_named_params) get the window's rescale too:
    with num_items they were left unscaled, a silently wrong gradient."""
    check(run_ranks(train, 2, {}, mode, False, {"delay": True}), {}, mode, 2)


# inside model.join(): rank 0 runs 2 windows, ranks 1 and 2 run 3; skips before the forward (the join handshake
# is replayed), in the forward, NaN, a local and a synced backward failing, while all are active and after rank 0
JOINED_WINDOWS = [2, 3, 3]
JOIN_FAULTS = {(0, 0, 1): "skip", (0, 2, 2): "forward", (1, 1, 0): "backward", (1, 2, 1): "skip",
               (2, 0, 2): "nan", (2, 2, 1): "backward", (2, 1, 2): "skip"}


def joined(rank, world_size, plan, mode, buffers):
    net = Faulty(buffers)
    model = gradsync.DDP(net, bucket_cap_mb=0.001)
    acc = gradsync.GradientAccumulator(model, steps=STEPS, skip_on=(OOM,), skip_nonfinite=True)
    opt = acc.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    skipped = []
    with model.join():
        for k, (x, y) in enumerate(acc.iterate(micro_batches(world_size)[:JOINED_WINDOWS[rank] * STEPS])):
            n = counts(k, rank)
            y = shard(y, rank, world_size)
            faulty_micro_step(acc, model, net, shard(x, rank, world_size), plan.get((*divmod(k, STEPS), rank)),
                              lambda out: (F.mse_loss(out, y),) if mode == "mean"
                              else (F.mse_loss(out[:n], y[:n], reduction="sum"), n))
            opt.step()
            opt.zero_grad()
            if acc.is_boundary:
                skipped.append(list(acc.skipped))
    return params(net), skipped, None


@pytest.mark.parametrize("mode,buffers", [("mean", True), ("items", False)])
def test_skips_inside_join_are_exact(mode, buffers):
    """A rank that ran out of data shadows the active ranks' collectives, their replays and skip records too."""
    gone = {(w, i, r): "gone" for r, n in enumerate(JOINED_WINDOWS) for w in range(n, WINDOWS) for i in range(STEPS)}
    results = run_ranks(joined, 3, JOIN_FAULTS, mode, buffers, timeout=120)
    want = reference({**JOIN_FAULTS, **gone}, mode, 3, buffers)
    for got, _, _ in results:
        assert_close_dicts(got, results[0][0], atol=0, rtol=0)  # the joined rank takes the others' state
    assert_close_dicts(results[0][0], want)
    assert [s for s in results[1][1]] == [s for s in results[2][1]]
    for w, records in enumerate(results[1][1]):
        assert {(r, i) for (pw, i, r) in JOIN_FAULTS if pw == w} <= {(r, i) for r, i, _ in records}, (w, records)


def step_inside_the_block(rank, world_size, after):
    """README's loop with the optimizer's lines inside the block (or ``after`` it); the last rank skips window 0's
    last micro-step."""
    torch.manual_seed(0)
    model = gradsync.DistributedDataParallel(nn.Linear(4, 2))
    acc = gradsync.GradientAccumulator(model, steps=2)
    opt = acc.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for i, x in enumerate(acc.iterate([torch.randn(3, 4) for _ in range(4)])):
        with acc.accumulate():
            if i == 1 and rank == world_size - 1:
                acc.skip("bad batch")
            acc.backward(model(x).pow(2).mean())
            if not after:
                opt.step(); opt.zero_grad()
        if after:
            opt.step(); opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_skip_that_leaves_the_block_before_its_optimizer_step_raises_on_that_rank(world_size):
    """A skip at a window's last micro-step leaves the block at once: the step and zero_grad written inside it did
    not run on that rank, which then trained on while the others stepped (the replicas parted) or added the next
    window onto this one's gradient."""
    results = run_ranks(step_inside_the_block, world_size, False, timeout=60, return_errors=True)
    text = str(results[-1])
    assert "optimizer.step()" in text and "zero_grad() after the block" in text, text
    after = run_ranks(step_inside_the_block, world_size, True, timeout=60)
    for p, q in zip(after[0], after[-1]):
        assert torch.equal(p, q)


def scaler_skips_the_window(rank, world_size):
    """Window 0's average is inf: every rank's GradScaler declines its step; the last rank's skip closed it, and the
    gradients are cleared by the model's zero_grad, not the wrapped optimizer's."""
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    model = gradsync.DistributedDataParallel(net)
    acc = gradsync.GradientAccumulator(model, steps=2)
    opt = acc.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    g = torch.Generator().manual_seed(rank)
    for i, x in enumerate(acc.iterate([torch.randn(3, 4, generator=g) for _ in range(6)])):
        if i == 0 and rank == 0:
            x = x.clone()
            x[0, 0] = float("inf")
        with acc.accumulate():
            if i == 1 and rank == world_size - 1:
                acc.skip("bad batch")
            acc.backward(scaler.scale(model(x).pow(2).mean()))
        if acc.is_boundary:
            scaler.step(opt)
            scaler.update()
            model.zero_grad()
    return [p.detach().clone() for p in net.parameters()]


def test_a_skip_closed_window_whose_step_the_scaler_declined_is_no_missed_step():
    """The check took any window without a wrapped step or zero_grad for one whose optimizer lines the skip jumped
    over, and raised on a correct loop."""
    first, second = run_ranks(scaler_skips_the_window, 2, timeout=60)
    for p, q in zip(first, second):
        assert torch.equal(p, q)
