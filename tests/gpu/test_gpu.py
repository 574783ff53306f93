"""gradsync on a GPU: no host sync in a steady-state step, torch's DDP's gradients, streams.

Skipped without CUDA; run with ``make test-gpu``. A single GPU gives a world of one on NCCL (NCCL
refuses two ranks on one device); two ranks share that GPU over gloo with CUDA tensors. The ranks
are spawned (``run_ranks`` does so for NCCL; the gloo test asks): a forked child cannot initialize CUDA
once the parent has touched the driver, which ``torch.cuda.is_available()`` may do.
"""
import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradsync
from gradsync.tools.launch import run_ranks
from helpers import assert_close_dicts

# device_count() asks NVML and leaves the driver alone: is_available() would initialize CUDA in pytest, and
# the replicas that `gradsync run` forks from it could then not use the GPU
pytestmark = pytest.mark.skipif(torch.cuda.device_count() == 0, reason="needs a CUDA device")
TorchDDP = nn.parallel.DistributedDataParallel


def net(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                         nn.Linear(256, 8)).to(dtype)


def device_of(rank: int) -> torch.device:
    d = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(d)
    return d


def data(device, steps, rank=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(10 + rank)
    return [(torch.randn(16, 64, generator=g).to(device, dtype), torch.randn(16, 8, generator=g).to(device, dtype))
            for _ in range(steps)]


def window(model, opt, batches, accum=1):
    for k, (x, y) in enumerate(batches[:accum]):
        with model.no_sync() if k < accum - 1 else contextlib.nullcontext():
            F.mse_loss(model(x).float(), y.float()).backward()
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)


def grads(model):
    return {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}


# ---------------------------------------------------------------- no host sync
def steady_state(rank, world_size, wrap, accum, check_finite=False):
    device = device_of(rank)
    model = wrap(net().to(device), check_finite)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batches = data(device, accum)
    for _ in range(3):  # warm-up: the bucket re-plan after the first synced backward broadcasts once
        window(model, opt, batches, accum)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            window(model, opt, batches, accum)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return True


def ours(module, check_finite):
    return gradsync.DDP(module, device_ids=[module[0].weight.device.index], check_finite=check_finite)


def theirs(module, _):
    return TorchDDP(module, device_ids=[module[0].weight.device.index])


@pytest.mark.parametrize("accum", [1, 4])
def test_steady_state_steps_make_no_host_sync(accum):
    assert run_ranks(steady_state, 1, theirs, accum, backend="nccl") == [True]  # the bar: torch's DDP
    assert run_ranks(steady_state, 1, ours, accum, backend="nccl") == [True]


def test_the_sync_check_can_fail():
    # check_finite reads every reduced bucket back: documented as a sync, and caught here
    with pytest.raises(Exception, match="synchroniz"):
        run_ranks(steady_state, 1, ours, 1, True, backend="nccl")


def control_group_is_cpu(rank, world_size):
    model = ours(net().to(device_of(rank)), False)
    return model.reducer.plane.device.type, model.reducer.plane.stream_waits


def test_the_control_plane_is_on_the_cpu():
    assert run_ranks(control_group_is_cpu, 1, backend="nccl") == [("cpu", True)]


# ---------------------------------------------------------------- gradients equal torch's DDP
def against_torch(rank, world_size, opts, accum, dtype=torch.float32):
    device = device_of(rank)
    a = gradsync.DDP(net(dtype).to(device), device_ids=[device.index], **opts)
    b = TorchDDP(net(dtype).to(device), device_ids=[device.index])
    out = []
    for model in (a, b):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for step in range(3):
            window(model, opt if step < 2 else None, data(device, accum, rank + step, dtype), accum)
        out.append(grads(model.module))
    views = all(p.grad.untyped_storage().data_ptr() in {bk.buffer.untyped_storage().data_ptr()
                                                        for bk in a.reducer.buckets}
                for p in a.parameters()) if opts.get("gradient_as_bucket_view") else None
    return out, views


@pytest.mark.parametrize("opts,accum", [({}, 1), ({}, 4), ({"bucket_cap_mb": 0.01}, 1),
                                        ({"gradient_as_bucket_view": True, "bucket_cap_mb": 0.01}, 4)])
def test_gradients_equal_torch_ddp_on_nccl(opts, accum):
    (mine, reference), views = run_ranks(against_torch, 1, opts, accum, backend="nccl")[0]
    assert_close_dicts(mine, reference)
    assert views in (None, True)


def test_two_ranks_share_one_gpu_over_gloo():
    ranks = run_ranks(against_torch, 2, {"bucket_cap_mb": 0.01}, 2, backend="gloo", start_method="spawn")
    for (mine, reference), _ in ranks:
        assert_close_dicts(mine, reference)


# ---------------------------------------------------------------- fp16 loss scaling on shards
def poison(grad):
    grad = grad.clone()
    grad.view(-1)[0] = float("inf")  # after the reduce-scatter: in one rank's shard only
    return grad


def scaled_shards(rank, world_size, kind="cuda"):
    """fp16 autocast and loss scaling: ShardedGradScaler on a sharded model, torch's scaler on torch's DDP; in step 1
    one element of rank 0's gradient is inf, so every rank must skip that step. ``kind="cpu"``: the same on the CPU."""
    device = device_of(rank) if kind == "cuda" else torch.device("cpu")
    ours = gradsync.ShardedDataParallel(net().to(device), bucket_cap_mb=0.01)
    theirs = TorchDDP(net().to(device))
    runs = [(ours, gradsync.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-3), gradsync.ShardedGradScaler(kind)),
            (theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-3), torch.amp.GradScaler(kind))]
    out = []
    for model, opt, scaler in runs:
        for step, (x, y) in enumerate(data(device, 4, rank)):
            with torch.autocast(kind, dtype=torch.float16):
                loss = F.mse_loss(model(x).float(), y)
            handle = model.module[0].weight.register_hook(poison) if step == 1 and rank == 0 else None
            scaler.scale(loss).backward()
            if handle is not None:
                handle.remove()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        out.append(({n: p.detach().float().cpu() for n, p in model.module.named_parameters()}, scaler.get_scale()))
    return out


def test_fp16_loss_scaling_on_shards_skips_together():
    for (mine, my_scale), (reference, their_scale) in run_ranks(scaled_shards, 2, backend="gloo", start_method="spawn"):
        assert my_scale == their_scale  # the poisoned step was skipped, and the scale backed off, on every rank
        assert_close_dicts(mine, reference)


def bf16_fp32_reduce(rank, world_size):
    device = device_of(rank)
    model = gradsync.DDP(net(torch.bfloat16).to(device), device_ids=[device.index], reduce_dtype=torch.float32)
    ref = net(torch.float32).to(device)
    ref.load_state_dict({k: v.float() for k, v in model.module.state_dict().items()})
    batches = data(device, 4)
    window(model, None, [(x.bfloat16(), y.bfloat16()) for x, y in batches], 4)
    for x, y in batches:
        F.mse_loss(ref(x.bfloat16().float()), y.bfloat16().float()).backward()
    return {n: p.main_grad.float().cpu() for n, p in model.module.named_parameters()}, grads(ref)


def test_bf16_model_accumulates_and_reduces_in_fp32():
    mine, reference = run_ranks(bf16_fp32_reduce, 1, backend="nccl")[0]
    assert_close_dicts(mine, reference, atol=5e-2, rtol=5e-2)  # bf16 forward, fp32 gradient sums


def layers_on_gpu(rank, world_size, kind):
    device = device_of(rank)
    base = net().to(device)
    batches = data(device, 4)
    if kind == "accumulator":
        model = gradsync.DDP(copy.deepcopy(base), device_ids=[device.index])
        acc = gradsync.GradientAccumulator(model, steps=4)
        for x, y in batches:
            with acc.accumulate():
                acc.backward(F.mse_loss(model(x), y, reduction="sum"), num_items=x.shape[0])
        scale = 4 * 16  # the reference: the summed loss over every row of the window
    elif kind == "sharded":
        model = gradsync.ShardedDataParallel(copy.deepcopy(base))
        opt = gradsync.ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
        window(model, opt, batches, 4)
        ref = TorchDDP(copy.deepcopy(base), device_ids=[device.index])
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        window(ref, ref_opt, batches, 4)
        return {n: p.detach().cpu() for n, p in model.module.named_parameters()}, \
            {n: p.detach().cpu() for n, p in ref.module.named_parameters()}
    else:  # compile
        model = torch.compile(gradsync.DDP(copy.deepcopy(base), device_ids=[device.index]))
        window(model, None, batches, 4)
        scale = None
    ref = copy.deepcopy(base)
    for x, y in batches:
        loss = F.mse_loss(ref(x), y, reduction="sum") / scale if scale else F.mse_loss(ref(x), y)
        loss.backward()
    mine = model.module if hasattr(model, "module") else model._orig_mod.module
    return grads(mine), grads(ref)


@pytest.mark.parametrize("kind", ["accumulator", "sharded", "compile"])
def test_layers_on_gpu_match_one_process(kind):
    mine, reference = run_ranks(layers_on_gpu, 1, kind, backend="nccl", timeout=300)[0]
    assert_close_dicts(mine, reference, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- streams
def side_stream(rank, world_size):
    """Forward and backward on a side stream: .grad is usable on that stream right after backward."""
    device = device_of(rank)
    a = gradsync.DDP(net().to(device), device_ids=[device.index], bucket_cap_mb=0.01)
    b = TorchDDP(net().to(device), device_ids=[device.index], bucket_cap_mb=0.01)
    out = []
    s = torch.cuda.Stream()
    for model in (a, b):
        batches = data(device, 3)
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                window(model, None, batches, 3)
                # read on the side stream without a sync: a wrong stream order shows as wrong values
                copies = {n: p.grad.clone() for n, p in model.module.named_parameters()}
                model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        out.append({n: t.cpu() for n, t in copies.items()})
    return out


def test_grads_are_ready_on_the_backward_stream():
    mine, reference = run_ranks(side_stream, 1, backend="nccl")[0]
    assert_close_dicts(mine, reference)
