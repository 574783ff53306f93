"""Communication hooks: torch's own hooks unchanged, gradsync's built-ins, hook rules, the trace."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import gradsync
from gradsync.tools.launch import run_ranks
from helpers import (Branches, assert_close_dicts, batches, grads, mlp, params, rank_steps, reference,
                     reference_unused, shard)

SMALL_BUCKETS = dict(bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005)


def with_hook(rank, world_size, hook_name, view):
    hook = {
        "torch_allreduce": default_hooks.allreduce_hook,
        "torch_fp16": default_hooks.fp16_compress_hook,
        "torch_bf16": default_hooks.bf16_compress_hook,
        "fp16": gradsync.fp16_compress_hook,
        "bf16": gradsync.bf16_compress_hook,
        "gradsync_allreduce": gradsync.allreduce_hook,
    }[hook_name]
    model = gradsync.DDP(mlp(seed=0), gradient_as_bucket_view=view, **SMALL_BUCKETS)
    model.register_comm_hook(None, hook)
    return rank_steps(model, rank, world_size, batches(2, world_size))


@pytest.mark.parametrize("hook_name,tol", [("torch_allreduce", 1e-5), ("gradsync_allreduce", 1e-5),
                                           ("torch_fp16", 2e-3), ("torch_bf16", 2e-2),
                                           ("fp16", 2e-3), ("bf16", 2e-2)])
@pytest.mark.parametrize("view", [False, True])
def test_hooks_produce_the_averaged_gradient(hook_name, tol, view):
    results = run_ranks(with_hook, 2, hook_name, view)
    want = reference(mlp(seed=0), batches(2, 2))
    for got in results:
        for g, w in zip(got, want):
            assert_close_dicts(g, w, atol=tol, rtol=tol)
    for g0, g1 in zip(*results):  # every rank holds the same reduced gradient
        for name in g0:
            assert torch.equal(g0[name], g1[name])


def chained(rank, world_size):
    model = gradsync.DDP(mlp(seed=0), **SMALL_BUCKETS)
    seen = []

    def hook(state, bucket):
        seen.append((bucket.index(), bucket.is_last(), bucket.buffer().numel(),
                     [g.shape for g in bucket.gradients()] == [p.shape for p in bucket.parameters()],
                     all(g.data_ptr() >= bucket.buffer().data_ptr() for g in bucket.gradients())))
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
        # sum -> average -> doubled -> halved: the chain must run in order on the value
        return (fut.then(lambda f: f.value()[0] / world_size)
                   .then(lambda f: f.value() * 2)
                   .then(lambda f: f.value() / 2))

    model.register_comm_hook(state={"anything": 1}, hook=hook)
    x, y = batches(1, world_size)[0]
    F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
    return seen, len(model.reducer.buckets), grads(model.module)


def test_custom_hook_chaining_then_callbacks_in_bucket_order():
    for seen, n_buckets, got in run_ranks(chained, 2):
        assert [s[0] for s in seen] == list(range(n_buckets)) and n_buckets > 2
        assert [s[1] for s in seen] == [False] * (n_buckets - 1) + [True]
        assert all(s[3] and s[4] for s in seen)
        assert_close_dicts(got, reference(mlp(seed=0), batches(1, 2))[0])


def hook_rules(rank, world_size, case):
    model = gradsync.DDP(mlp(seed=0), **SMALL_BUCKETS)
    x, y = batches(1, world_size)[0]
    run = lambda: F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()  # noqa: E731
    if case == "not_callable":
        with pytest.raises(TypeError, match="callable"):
            model.register_comm_hook(None, "allreduce")
    elif case == "three_arguments":  # refused at registration, as torch refuses it, not at the first backward
        with pytest.raises(TypeError, match="cannot be called as hook\\(state, bucket\\)"):
            model.register_comm_hook(None, lambda state, bucket, extra: bucket.buffer())
    elif case == "twice":
        model.register_comm_hook(None, gradsync.allreduce_hook)
        with pytest.raises(RuntimeError, match="only be called once"):
            model.register_comm_hook(None, gradsync.allreduce_hook)
    elif case == "after_training":
        run()
        with pytest.raises(RuntimeError, match="before the first backward"):
            model.register_comm_hook(None, gradsync.allreduce_hook)
    elif case == "wrong_shape":
        def bad(state, bucket):
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer()[:1])
            return fut
        model.register_comm_hook(None, bad)
        with pytest.raises(TypeError, match="bucket 0 yielded a tensor of 1 elements"):
            run()
    elif case == "wrong_type":
        def bad(state, bucket):
            fut = torch.futures.Future()
            fut.set_result("not a tensor")
            return fut
        model.register_comm_hook(None, bad)
        with pytest.raises(TypeError, match="bucket 0 yielded str"):
            run()
    elif case == "not_a_future":
        model.register_comm_hook(None, lambda state, bucket: bucket.buffer())
        with pytest.raises(RuntimeError, match="callback must return a torch.futures.Future object, but got "
                                               "torch.Tensor"):  # torch's sentence and type
            run()


@pytest.mark.parametrize("case", ["not_callable", "three_arguments", "twice", "after_training", "wrong_shape",
                                  "wrong_type", "not_a_future"])
def test_hook_rules(case):
    run_ranks(hook_rules, 2, case, pg_timeout=5)


def noop_and_no_sync(rank, world_size):
    model = gradsync.DDP(mlp(seed=0), **SMALL_BUCKETS)
    calls = []
    model.register_comm_hook(calls, lambda state, bucket: (state.append(bucket.index()),
                                                           gradsync.noop_hook(state, bucket))[1])
    x, y = batches(1, world_size)[0]
    xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
    with model.no_sync():
        F.mse_loss(model(xs), ys).backward()
    calls_in_no_sync = len(calls)
    local = grads(model.module)
    for p in model.parameters():
        p.grad = None
    F.mse_loss(model(xs), ys).backward()
    return calls_in_no_sync, len(calls), local, grads(model.module)


def test_no_hook_calls_under_no_sync_and_noop_hook_keeps_local_gradients():
    for calls_in_no_sync, calls, local, synced in run_ranks(noop_and_no_sync, 2):
        assert calls_in_no_sync == 0 and calls > 0
        assert_close_dicts(synced, local)


def hook_with_unused(rank, world_size):
    model = gradsync.DDP(Branches(), find_unused_parameters=True, bucket_cap_mb=1e-4, first_bucket_cap_mb=1e-4)
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    x, y = batches(1, world_size)[0]
    F.mse_loss(model(shard(x, rank, world_size), use_b=rank == 0), shard(y, rank, world_size)).backward()
    return grads(model.module)


def test_hooks_with_unused_parameters():
    results = run_ranks(hook_with_unused, 2)
    want = reference_unused([(True, False)], 2)  # b on rank 0 only; never: unused, stays None
    for got in results:
        assert_close_dicts(got, want)


class Deep(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])

    def forward(self, x):
        return self.layers(x)


def overlap(rank, world_size):
    model = gradsync.DDP(Deep(), bucket_cap_mb=0.3, first_bucket_cap_mb=0.3)
    trace = model.enable_comm_trace()
    reached_input = []
    for _ in range(2):
        x = torch.randn(16, 256).requires_grad_()
        x.register_hook(lambda g: reached_input.append(__import__("time").perf_counter()))
        model(x).sum().backward()
    return trace, reached_input, len(model.reducer.buckets)


def test_trace_shows_the_first_bucket_launched_before_backward_reaches_the_input():
    for trace, reached_input, n_buckets in run_ranks(overlap, 2):
        assert n_buckets >= 2 and len(trace) == 2
        for it, t_input in zip(trace, reached_input):
            first = it["buckets"][0]
            assert it["backward_start"] <= first["ready"] <= first["launch"] < t_input
            assert first["launch"] <= first["done"] <= it["backward_end"]
            assert [b["index"] for b in it["buckets"]] == list(range(n_buckets))
            assert sum(b["bytes"] for b in it["buckets"]) == 6 * (256 * 256 + 256) * 4



def power_sgd(rank, world_size, buckets):
    """torch's powerSGD_hook issues collectives from its futures' callbacks, on gloo's thread."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
    # the hook draws a seed per bucket, so compare with torch only where both have one bucket
    wrappers = [("torch", nn.parallel.DistributedDataParallel)] if buckets == "one" else []
    out = {}
    for name, wrap in wrappers + [("gradsync", gradsync.DDP)]:
        torch.manual_seed(0)
        module = nn.Linear(1, 5) if buckets == "one" else mlp(seed=0)
        model = wrap(module, **({} if buckets == "one" else SMALL_BUCKETS))
        model.register_comm_hook(powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                                        start_powerSGD_iter=2), powerSGD.powerSGD_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(rank)
        for _ in range(20):
            model(torch.randn(4, 1 if buckets == "one" else 8, generator=g)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        out[name] = params(model.module)
    return out, len(model.reducer.buckets)


@pytest.mark.parametrize("buckets", ["one", "many"])
def test_power_sgd_hook_trains_in_step_on_every_rank(buckets):
    results = run_ranks(power_sgd, 2, buckets)
    for result, n_buckets in results:
        assert (n_buckets == 1) == (buckets == "one")
        if "torch" in result:
            assert_close_dicts(result["gradsync"], result["torch"], atol=1e-6, rtol=1e-6)
    (first, _), (second, _) = results
    for name, value in first["gradsync"].items():  # the ranks agree bit for bit
        assert torch.equal(value, second["gradsync"][name])


def test_which_hooks_may_overlap_their_buckets():
    """Hooks that issue one collective launch buckets back to back; others wait for the previous future."""
    import functools

    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD

    from gradsync.engine.launcher import issues_one_collective, one_collective

    for hook in (gradsync.allreduce_hook, gradsync.bf16_compress_hook, default_hooks.allreduce_hook,
                 default_hooks.fp16_compress_hook, functools.partial(default_hooks.allreduce_hook)):
        assert issues_one_collective(hook)
    mine = lambda state, bucket: default_hooks.allreduce_hook(state, bucket)  # noqa: E731
    assert not issues_one_collective(mine) and not issues_one_collective(powerSGD.powerSGD_hook)
    assert issues_one_collective(one_collective(mine))


def compressed_side_by_side(rank, world_size, view):
    """gradsync's bf16_compress_hook and torch's (torch's DDP refuses bf16 hooks on CPU, so both run
    in gradsync's DDP), same process group; 3 steps."""
    from gradsync.hooks import default as comm

    ours = gradsync.DDP(mlp(seed=0), gradient_as_bucket_view=view, **SMALL_BUCKETS)
    ours.register_comm_hook(None, gradsync.bf16_compress_hook)
    theirs = gradsync.DDP(mlp(seed=0), **SMALL_BUCKETS)
    theirs.register_comm_hook(None, default_hooks.bf16_compress_hook)
    data = batches(3, world_size)
    pools = []
    for j in range(3):
        got = rank_steps(ours, rank, world_size, data[j:j + 1])[0]
        want = rank_steps(theirs, rank, world_size, data[j:j + 1])[0]
        for name in want:
            assert torch.equal(got[name], want[name]), (j, name)
        pools.append({t.data_ptr() for t in comm.wire_pool.free})
    return pools


@pytest.mark.parametrize("world_size,view", [(2, False), (3, True)])
def test_bf16_compress_hook_matches_torchs_and_reuses_its_wire_buffers(world_size, view):
    """Bit-identical to torch's hook (3 ranks: division after rounding, as torch); the bf16 buffers
    of one backward are the next backward's (fresh ones would cost page faults every step)."""
    for pools in run_ranks(compressed_side_by_side, world_size, view):
        assert pools[0] and pools[0] == pools[1] == pools[2]


def wire_exact(rank, world_size):
    """bf16_wire_hook against its definition: round each rank's gradient to bf16, average in fp32
    (rank order), round the average to bf16. Returns the wire buffers seen after each step."""
    from gradsync.hooks import default as comm

    model = gradsync.DDP(mlp(seed=0), **SMALL_BUCKETS)
    model.register_comm_hook(None, gradsync.bf16_wire_hook)
    plain = mlp(seed=0)
    pools = []
    for x, y in batches(3, world_size):  # 2 ranks pipeline the buckets: the first backward may reuse early
        got = rank_steps(model, rank, world_size, [(x, y)])[0]
        plain.zero_grad()
        F.mse_loss(plain(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
        for name, p in plain.named_parameters():
            parts = [torch.empty_like(p.grad) for _ in range(world_size)]
            dist.all_gather(parts, p.grad)
            total = parts[0].to(torch.bfloat16).float()
            for part in parts[1:]:
                total += part.to(torch.bfloat16).float()
            assert torch.equal(got[name], (total / world_size).to(torch.bfloat16).float()), name
        pools.append({t.data_ptr() for t in comm.wire_pool.free})
    return pools


@pytest.mark.parametrize("world_size", [2, 3])
def test_bf16_wire_hook_is_exactly_its_definition(world_size):
    for pools in run_ranks(wire_exact, world_size):
        assert pools[1] and pools[1] == pools[2]


def wrapped(rank, world_size, wrapper, inner):
    """torch's compression wrappers around a hook, in torch's DDP and in gradsync's, one process group."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    out = []
    for wrap in (nn.parallel.DistributedDataParallel, gradsync.DDP):
        model = wrap(mlp(seed=0))
        state = powersgd.PowerSGDState(None, start_powerSGD_iter=2) if inner == "powerSGD" else None
        hook = getattr(default_hooks, wrapper)(powersgd.powerSGD_hook if inner == "powerSGD" else default_hooks.allreduce_hook)
        if wrapper.startswith("bf16") and wrap is not gradsync.DDP:  # torch's DDP refuses bf16 hooks on CPU: the
            model, hook = gradsync.DDP(mlp(seed=0)), default_hooks.bf16_compress_hook  # hook the wrapper equals
        model.register_comm_hook(state, hook)
        out.append(rank_steps(model, rank, world_size, batches(4, world_size),
                              torch.optim.SGD(model.parameters(), lr=0.1)))
    return out


@pytest.mark.parametrize("wrapper,inner", [("fp16_compress_wrapper", "allreduce"),
                                           ("fp16_compress_wrapper", "powerSGD"),
                                           ("bf16_compress_wrapper", "allreduce")])
def test_torchs_compression_wrappers_compress_as_in_torch(wrapper, inner):
    # the wrapper hands the hook a half-precision buffer through bucket.set_buffer: the wire carries it, and the
    # future's half-precision result comes back into the bucket's dtype
    for theirs, ours in run_ranks(wrapped, 2, wrapper, inner):
        for step, (a, b) in enumerate(zip(theirs, ours)):
            for name in a:
                assert torch.equal(a[name], b[name]), (step, name)


def hooks_that_differ(rank, world_size, case):
    model = gradsync.DDP(mlp(seed=0), **SMALL_BUCKETS)
    if case == "one_rank" and rank == 0:  # fp16 on the wire against fp32: gloo would abort the process
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    if case == "two_hooks":
        model.register_comm_hook(None, [default_hooks.allreduce_hook, gradsync.bf16_compress_hook][rank])
    if case == "fp16_bf16":  # the same bytes on the wire: gloo would add fp16 bits to bf16 bits without a word
        model.register_comm_hook(None, [gradsync.fp16_compress_hook, gradsync.bf16_compress_hook][rank])
    x, y = batches(1, world_size)[0]
    with pytest.raises(gradsync.SyncError) as raised:
        F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
    return str(raised.value)


@pytest.mark.parametrize("case", ["one_rank", "two_hooks", "fp16_bf16"])
def test_ranks_with_different_comm_hooks_raise_on_every_rank_before_a_bucket(case):
    messages = run_ranks(hooks_that_differ, 2, case, pg_timeout=20)
    own = {"one_rank": ["fp16_compress_hook", "none"], "two_hooks": ["allreduce_hook", "bf16_compress_hook"],
           "fp16_bf16": ["fp16_compress_hook", "bf16_compress_hook"]}[case]
    for rank, message in enumerate(messages):
        assert "different communication hooks" in message and own[rank] in message, message
        assert "register_comm_hook" in message
