"""Core engine: equivalence with one process and with torch's DDP, no_sync, buffers, bad input."""
import copy
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gradsync
from gradsync.tools.launch import RankError, run_ranks
from helpers import (Normed, assert_close_dicts, batches, count_collectives, grads, mlp, params, rank_steps,
                     reference, shard)

CAPS = {"tiny": dict(bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005),
        "default": {}, "huge": dict(bucket_cap_mb=1000, first_bucket_cap_mb=1000)}


def make_opt(kind, ps):
    if kind == "sgd":
        return torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    return torch.optim.Adam(ps, lr=0.01)


def train_ddp(rank, world_size, caps, opt_kind, steps):
    model = gradsync.DDP(mlp(seed=rank), **caps)  # ranks start from different weights
    history = rank_steps(model, rank, world_size, batches(steps, world_size), make_opt(opt_kind, model.parameters()))
    return history, params(model.module)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("caps", list(CAPS))
@pytest.mark.parametrize("opt_kind", ["sgd", "adam"])
def test_equivalent_to_one_process_on_the_global_batch(world_size, caps, opt_kind):
    steps = 4
    results = run_ranks(train_ddp, world_size, CAPS[caps], opt_kind, steps)
    ref = mlp(seed=0)
    ref_history = reference(ref, batches(steps, world_size), opt=make_opt(opt_kind, ref.parameters()))
    ref_params = params(ref)
    for history, final in results:
        for got, want in zip(history, ref_history):
            assert_close_dicts(got, want)
        assert_close_dicts(final, ref_params, atol=1e-5)
    for _, final in results[1:]:  # bit-for-bit agreement across ranks
        for name in final:
            assert torch.equal(final[name], results[0][1][name]), name


def against_torch_ddp(rank, world_size, steps):
    ours = gradsync.DDP(mlp(seed=rank), bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)
    theirs = nn.parallel.DistributedDataParallel(mlp(seed=rank), bucket_cap_mb=0.002)
    opt_a = torch.optim.Adam(ours.parameters(), lr=0.01)
    opt_b = torch.optim.Adam(theirs.parameters(), lr=0.01)
    for x, y in batches(steps, world_size):
        xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
        for model, opt in ((ours, opt_a), (theirs, opt_b)):
            opt.zero_grad()
            F.mse_loss(model(xs), ys).backward()
            opt.step()
    return params(ours.module), params(theirs.module)


@pytest.mark.parametrize("world_size", [2, 4])
def test_matches_torch_ddp_in_the_same_process_group(world_size):
    for ours, theirs in run_ranks(against_torch_ddp, world_size, 5):
        assert_close_dicts(ours, theirs, atol=1e-6)


def torchs_bits(rank, world_size, view, set_to_none, local):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    ours = gradsync.DDP(copy.deepcopy(net), gradient_as_bucket_view=view)
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(net), gradient_as_bucket_view=view)
    pairs = [(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)) for m in (ours, theirs)]
    differ = []
    for step, (x, y) in enumerate(batches(5, world_size, per_rank=4)):
        xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
        for model, opt in pairs:
            opt.zero_grad(set_to_none=set_to_none)
            if local:
                with model.no_sync():
                    F.mse_loss(model(xs), ys).backward()
            F.mse_loss(model(xs.flip(0)), ys.flip(0)).backward()
            if step > 0:  # the first backward sums in the first layout, not torch's (differences.md)
                opt.step()
        differ.append(sum(int((a.grad != b.grad).sum()) for a, b in zip(ours.parameters(), theirs.parameters())))
    return differ, params(ours.module), params(theirs.module)


@pytest.mark.parametrize("view,set_to_none,local", [(False, True, True), (True, True, False), (True, True, True),
                                                   (True, False, True)])
def test_three_ranks_average_to_torchs_bits(view, set_to_none, local):
    """torch's reducer scales a gradient it copies in by 1 / W and divides one that already is its view by W; at W=3
    x / 3 and x * (1 / 3) differ in the last bit for about a third of the values (differences.md)."""
    for differ, ours, theirs in run_ranks(torchs_bits, 3, view, set_to_none, local):
        assert differ[1:] == [0] * 4, differ
        assert all(torch.equal(ours[name], theirs[name]) for name in ours)


def accumulate(rank, world_size, form, micro_steps):
    model = gradsync.DDP(mlp(seed=0), bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005)
    calls = count_collectives(model)
    data = batches(micro_steps, world_size)
    calls_per_micro = []
    for k, (x, y) in enumerate(data):
        xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
        last = k == micro_steps - 1
        before = len(calls)
        if last:
            loss = F.mse_loss(model(xs), ys) / micro_steps
            loss.backward()
        elif form == "context":
            with model.no_sync():
                (F.mse_loss(model(xs), ys) / micro_steps).backward()
        elif form == "backward_only":
            loss = F.mse_loss(model(xs), ys) / micro_steps
            with model.no_sync():
                loss.backward()
        else:  # the attribute, nanoGPT style
            model.require_backward_grad_sync = False
            (F.mse_loss(model(xs), ys) / micro_steps).backward()
            model.require_backward_grad_sync = True
        calls_per_micro.append(len(calls) - before)
        if not last:
            local = grads(model.module)
    return calls_per_micro, len(model.reducer.buckets), local, grads(model.module)


@pytest.mark.parametrize("form", ["context", "backward_only", "attribute"])
def test_no_sync_accumulates_locally_then_syncs_once(form):
    world_size, micro = 2, 3
    results = run_ranks(accumulate, world_size, form, micro)
    (want,) = reference(mlp(seed=0), batches(micro, world_size), steps=micro)
    locals_ = []
    for rank, (calls, n_buckets, local, synced) in enumerate(results):
        assert calls == [0] * (micro - 1) + [n_buckets]
        assert_close_dicts(synced, want)
        locals_.append(local)
    # inside no_sync the ranks' gradients are their own, not averaged
    assert not torch.allclose(locals_[0]["0.weight"], locals_[1]["0.weight"])


def buffers_follow_rank0(rank, world_size):
    model = gradsync.DDP(Normed(width=8))  # Normed seeds the generator: the data below repeat
    seen = []  # the buffers each inner forward starts from, i.e. after gradsync's broadcast
    model.module.register_forward_pre_hook(
        lambda mod, args: seen.append({n: b.clone() for n, b in mod.named_buffers()}))
    for step in range(3):
        x = torch.randn(4, 8) * (rank + 1) + rank  # different statistics on each rank
        model(x).sum().backward()
    return seen


def test_buffers_are_broadcast_from_rank0_before_each_forward():
    results = run_ranks(buffers_follow_rank0, 2)
    for step in range(1, 3):
        for name in results[0][step]:
            assert torch.equal(results[0][step][name], results[1][step][name]), (step, name)
    # without the broadcast rank 1's running mean would have drifted to its own data
    assert not torch.equal(results[0][1]["bn.running_mean"], torch.zeros(8))


def mismatched(rank, world_size, how):
    torch.manual_seed(0)
    kwargs = {}
    if how == "shape":
        module = nn.Linear(8, 4 if rank == 0 else 5)
    elif how == "count":
        module = nn.Sequential(*[nn.Linear(4, 4) for _ in range(2 + (rank == 1))])
    elif how == "strides":  # one rank's model channels_last: its bucket slots would hold the elements in another order
        module = nn.Conv2d(3, 4, 3)
        if rank == 1:
            module.to(memory_format=torch.channels_last)
    elif how == "delay":  # rank 1 reduces the weight after the backward, rank 0 in its bucket: gloo aborted
        module = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2))
        if rank == 1:
            kwargs = {"delay_all_reduce_named_params": [("1.weight", module[1].weight)],
                      "param_to_hook_all_reduce": module[0].weight}
    else:  # options that decide the buckets or the control: a gloo size mismatch (an abort) or a timeout later
        module = nn.Linear(8, 4)
        kwargs = {"bucket_cap_mb": 25 if rank == 0 else 0.0005} if how == "caps" else {"find_unused_parameters": rank == 1}
    start = time.monotonic()
    try:
        gradsync.DDP(module, **kwargs)
    except ValueError as exc:
        return str(exc), time.monotonic() - start
    return None, 0.0


@pytest.mark.parametrize("how", ["shape", "count", "strides", "caps", "find_unused", "delay"])
def test_mismatched_models_raise_on_every_rank(how):
    results = run_ranks(mismatched, 2, how, timeout=30)
    for message, elapsed in results:
        assert message is not None
        assert "rank 1" in message and "differs across ranks" in message
        assert elapsed < 5
    if how == "shape":
        assert "weight" in results[0][0] and "(5, 8)" in results[0][0]
    if how == "strides":
        assert "parameter 'weight' has strides (27, 1, 9, 3) (rank 0: (27, 9, 3, 1))" in results[0][0], results[0][0]
    if how == "caps":
        assert "bucket_cap_mb=0.0005 (rank 0: 25" in results[0][0], results[0][0]
    if how == "find_unused":
        assert "find_unused_parameters=True (rank 0: False)" in results[0][0], results[0][0]
    if how == "delay":
        assert "delay_all_reduce_named_params=['1.weight'] (rank 0: [])" in results[0][0], results[0][0]


def no_trainable(rank, world_size):
    module = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(RuntimeError, match="no parameters that require gradients"):  # as torch
        gradsync.DDP(module)


def test_module_without_trainable_parameters_raises():
    run_ranks(no_trainable, 2)


def state_dict_and_world_of_one(rank, world_size):
    model = gradsync.DDP(mlp())
    keys = list(model.state_dict())
    torch_keys = list(nn.parallel.DistributedDataParallel(mlp()).state_dict())
    x, y = batches(1, 1)[0]
    F.mse_loss(model(x), y).backward()
    model.load_state_dict(model.state_dict())
    return keys, torch_keys, grads(model.module)


def test_state_dict_keys_and_world_size_one():
    keys, torch_keys, got = run_ranks(state_dict_and_world_of_one, 1)[0]
    assert keys == torch_keys and keys[0].startswith("module.")
    assert_close_dicts(got, reference(mlp(), batches(1, 1))[0])


def failing(rank, world_size):
    raise ValueError(f"boom on {rank}")


def test_run_ranks_reports_the_failing_rank():
    with pytest.raises(RankError, match="rank 0: ValueError: boom on 0"):
        run_ranks(failing, 2)


def sleeper(rank, world_size):
    time.sleep(60 if rank == 1 else 0)


def test_run_ranks_kills_stuck_ranks():
    start = time.monotonic()
    with pytest.raises(RankError, match="rank 1: still running"):
        run_ranks(sleeper, 2, timeout=2)
    assert time.monotonic() - start < 10


PARENT_ONLY: list[str] = []  # set in the parent below: a forked rank sees it, a spawned one imports afresh


def seen_from_rank(rank, world_size):
    return list(PARENT_ONLY), dist.get_world_size()


def test_run_ranks_spawns_for_cuda_and_when_asked():
    # CUDA ranks are spawned (a forked child cannot initialize CUDA once the parent touched the driver)
    PARENT_ONLY.append("parent")
    try:
        assert run_ranks(seen_from_rank, 1) == [(["parent"], 1)]
        assert run_ranks(seen_from_rank, 1, start_method="spawn", timeout=120) == [([], 1)]
    finally:
        PARENT_ONLY.clear()


def needs_init(rank, world_size):
    dist.destroy_process_group()
    with pytest.raises(RuntimeError, match="init_process_group"):
        gradsync.DDP(mlp())


def test_wrapping_without_a_process_group_raises():
    run_ranks(needs_init, 1)


def train_with_local_eval(rank, world_size, evaluate):
    model = gradsync.DDP(Normed(width=8), timeout=5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for step in range(3):
        x = torch.randn(4, 8, generator=g) * (rank + 1)
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        if evaluate and rank == 0:  # rank-local evaluation: must not need the other rank
            model.eval()
            with torch.no_grad():
                model(torch.ones(4, 8))
            model(torch.ones(4, 8))  # eval mode, gradients on, no backward: harmless too
            model.train()
    return params(model.module), {n: b.clone() for n, b in model.module.named_buffers()}


def test_rank_local_evaluation_needs_no_collective_and_changes_nothing():
    with_eval = run_ranks(train_with_local_eval, 2, True, timeout=30)
    without = run_ranks(train_with_local_eval, 2, False, timeout=30)
    for (p_eval, b_eval), (p_plain, b_plain) in zip(with_eval, without):
        for name in p_plain:
            assert torch.equal(p_eval[name], p_plain[name]), name
        for name in b_plain:  # eval-mode forwards do not update running statistics either
            assert torch.equal(b_eval[name], b_plain[name]), name


def evaluated_in_another_thread(rank, world_size, kw):
    """A no-grad forward through the wrapper in another thread (an asynchronous evaluator, a sampler) while this
    thread's synced backward runs: started from a gradient hook late in the backward, and waited for there."""
    model = gradsync.DDP(mlp(seed=0), bucket_cap_mb=0.001, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def evaluate(_param):
        def no_grad_forward():
            with torch.no_grad():
                model(torch.ones(2, 8))
        worker = threading.Thread(target=no_grad_forward)
        worker.start()
        worker.join()
    first = next(model.module.parameters())  # among the backward's last gradients: the others' buckets are in flight
    first.register_post_accumulate_grad_hook(evaluate)
    for x, y in batches(3, world_size):
        F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
        opt.step()
        opt.zero_grad()
    return params(model.module)


@pytest.mark.parametrize("kw", [{}, {"gradient_as_bucket_view": True}], ids=["default", "views"])
def test_a_no_grad_forward_in_another_thread_leaves_the_running_backward_alone(kw):
    """Each forward dropped the state of a backward still in progress, taking it for one that had raised: the
    synced backward ended in an IndexError, a SyncError or a refused step."""
    results = run_ranks(evaluated_in_another_thread, 2, kw, timeout=60)
    model = mlp(seed=0)
    reference(model, batches(3, 2), opt=torch.optim.SGD(model.parameters(), lr=0.1))
    for got in results:
        assert_close_dicts(got, params(model), atol=1e-6)


def converted_after_wrapping(rank, world_size, how):
    model = gradsync.DDP(Normed(width=8), timeout=5)
    ran = []
    model.module.register_forward_pre_hook(lambda *_: ran.append(True))
    if how == "meta":
        model.to("meta")  # new Parameter objects, unlike the dtype conversions
    else:
        getattr(model if how == "double" else model.module, how)()  # the wrapper or the module
        model.module.bn.running_mean.fill_(rank)
    dtype = {"double": torch.float64, "half": torch.float16, "meta": torch.float32}[how]
    device = "meta" if how == "meta" else "cpu"
    with pytest.raises(RuntimeError, match=f"changed from torch.float32 on cpu to {dtype} on {device} after the "
                                           r"module was wrapped .* before wrapping"):
        model(torch.randn(4, 8, dtype=dtype, device=device))
    assert not ran
    if how != "meta":  # raised before the buffer broadcast: rank 1 kept its own running mean
        assert torch.equal(model.module.bn.running_mean, torch.full((8,), float(rank), dtype=dtype))


@pytest.mark.parametrize("how", ["double", "half", "meta"])
def test_parameters_converted_after_wrapping_raise_at_the_next_forward(how):
    run_ranks(converted_after_wrapping, 2, how, timeout=60)


def mixed_broadcast(rank, world_size, chunk_bytes):
    """``broadcast_coalesced`` over tensors of six dtypes, one non-contiguous, one 0-d, one empty."""
    from gradsync.ddp.construct import broadcast_coalesced

    g = torch.Generator().manual_seed(rank)  # every rank starts from different values
    tensors = [torch.randn(5, 3, generator=g), torch.randn(4, 6, generator=g).t(),
               torch.tensor(7 + rank, dtype=torch.int64), torch.rand(9, generator=g) > 0.5,
               torch.randn(3, generator=g, dtype=torch.float64), torch.randn(6, generator=g).bfloat16(),
               torch.empty(0), torch.randn(2, generator=g, dtype=torch.complex64)]
    works = []
    broadcast_coalesced(tensors, dist.group.WORLD, lambda w: (works.append(w), w.wait()), 0, chunk_bytes)
    return tensors, len(works)


@pytest.mark.parametrize("chunk_bytes,broadcasts", [(25 << 20, 1), (40, 5)])
def test_buffers_of_every_dtype_take_one_broadcast_per_chunk(chunk_bytes, broadcasts):
    """Packed as bytes, BatchNorm's float and int64 buffers cost one round trip per forward, not two."""
    (src, n0), (got, n1) = run_ranks(mixed_broadcast, 2, chunk_bytes)
    assert n0 == n1 == broadcasts
    for a, b in zip(src, got):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
