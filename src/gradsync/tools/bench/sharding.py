"""The sharded engines that ``benchmarks/sharded/`` puts side by side, one API for all of them.

An ``Engine`` here builds its own (model, optimizer) pair from a module (``build``), so gradsync's
``ShardedDataParallel`` + ``ShardedOptimizer``, torch's DDP, ZeRO (``ZeroRedundancyOptimizer``, also
overlapped with DDP's comm hook) and FSDP2 (``fully_shard``) run through the same ``micro_step`` /
``optimizer_step`` calls, so ``harness.run_window`` times them all. ``time_rank`` alternates engines
(an engine that fails to build or run is reported, not timed); ``memory_rank`` measures one alone.
"""
from __future__ import annotations

import copy
import gc
import time

import torch
import torch.distributed as dist
from torch import nn

import gradsync

from .harness import reduce_max, reset_peak_rss, round_order, run_window, status_kib, mmap_large_allocations
from .models import ModelSpec, loss_fn

MODELS = [ModelSpec(name="mlp-8.4M", kind="mlp", width=1024, depth=8, batch=32),
          ModelSpec(name="gpt-12M", kind="gpt", width=384, depth=6, batch=2, seq=64)]
QUICK = [ModelSpec(name="mlp-tiny", kind="mlp", width=64, depth=2, batch=4)]
LR = 1e-3


class Engine:
    """``micro_step(x, y, sync)`` then ``optimizer_step()``, for one implementation on its own model copy."""

    def __init__(self, module: nn.Module):
        self.model, self.opt = self.build(module)

    def micro_step(self, x, y, sync: bool) -> None:
        if sync:
            loss_fn(self.model(x), y).backward()
        else:
            with self.model.no_sync():
                loss_fn(self.model(x), y).backward()

    def optimizer_step(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class TorchDDP(Engine):
    def build(self, module):
        model = nn.parallel.DistributedDataParallel(module)
        return model, torch.optim.AdamW(model.parameters(), lr=LR)


class Sharded(Engine):
    def build(self, module):
        model = gradsync.ShardedDataParallel(module)
        return model, gradsync.ShardedOptimizer(model, torch.optim.AdamW, lr=LR)


class ShardedSmallBuckets(Engine):
    """Buckets of about one layer, as FSDP2 shards per layer: less staging memory."""

    def build(self, module):
        model = gradsync.ShardedDataParallel(module, bucket_cap_mb=4, first_bucket_cap_mb=1)
        return model, gradsync.ShardedOptimizer(model, torch.optim.AdamW, lr=LR)


class Zero(Engine):
    def build(self, module):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        model = nn.parallel.DistributedDataParallel(module)
        return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)


class ZeroOverlap(Engine):
    """ZeRO's step runs inside DDP's comm hook, bucket by bucket (``step()`` is then a no-op)."""

    def build(self, module):
        from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import hook_with_zero_step
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.distributed.optim import ZeroRedundancyOptimizer
        model = nn.parallel.DistributedDataParallel(module)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                      overlap_with_ddp=True, lr=LR)
        model.register_comm_hook(None, hook_with_zero_step(allreduce_hook, model, opt))
        return model, opt


class FSDP2(Engine):
    """``fully_shard`` per layer and at the root, parameters kept unsharded after forward."""

    def build(self, module):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        layers = getattr(module, "layers", None) or getattr(module, "blocks")
        for layer in layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=False)
        fully_shard(module, mesh=mesh, reshard_after_forward=False)
        return module, torch.optim.AdamW(module.parameters(), lr=LR)

    def micro_step(self, x, y, sync: bool) -> None:
        self.model.set_requires_gradient_sync(sync)
        loss_fn(self.model(x), y).backward()


ENGINES = {"torch-ddp": TorchDDP, "gradsync-sharded": Sharded, "sharded-4mb": ShardedSmallBuckets, "zero": Zero,
           "zero-overlap": ZeroOverlap, "fsdp2": FSDP2}



def build_engines(names: list[str], spec: ModelSpec) -> tuple[dict[str, Engine], dict[str, str]]:
    """Each named engine on its own copy of ``spec``'s model, and why the others failed to build."""
    base = spec.build(seed=0)
    engines, failed = {}, {}
    for name in names:
        try:
            engines[name] = ENGINES[name](copy.deepcopy(base))
        except Exception as exc:  # noqa: BLE001  (recorded in the results: why it cannot run here)
            failed[name] = f"{type(exc).__name__}: {exc}"[:400]
    return engines, failed


def time_rank(rank, world, spec, names, accum, warmup, reps) -> dict:
    """Window times (max over ranks) of ``names`` alternating, what failed, and each model's final parameter sum."""
    torch.set_num_threads(1)
    engines, failed = build_engines(names, spec)
    for name in list(engines):  # a first window each: an engine failing here is reported, not timed
        try:
            run_window(engines[name], spec, rank, 0, accum)
        except Exception as exc:  # noqa: BLE001
            failed[name] = f"{type(exc).__name__}: {exc}"[:400]
            del engines[name]
    order = list(engines)
    times = {n: [] for n in order}
    for rep in range(warmup + reps):
        for name in round_order(order, rep):
            dist.barrier()
            start = time.perf_counter()
            run_window(engines[name], spec, rank, rep + 1, accum)
            wall = reduce_max([time.perf_counter() - start])[0]
            if rep >= warmup:
                times[name].append(wall)
    final = {n: sum(p.detach().double().sum().item() for p in e.model.parameters()) for n, e in engines.items()}
    return {"times": times, "failed": failed, "param_sums": final}


def memory_rank(rank, world, spec, name, warmup, steps) -> dict:
    """Peak RSS above the pre-model baseline of engine ``name`` (a key of ``ENGINES``, or an Engine class),
    alone in this rank: steady state (``peak_mib``) and the whole run with construction (``whole_run_peak_mib``)."""
    torch.set_num_threads(1)
    mmap_large_allocations()
    warm = nn.Linear(8, 8)
    warm(torch.randn(2, 8)).sum().backward()
    dist.all_reduce(warm.weight.grad)
    del warm
    gc.collect()
    base = status_kib("VmRSS")
    reset_peak_rss()
    engine = (ENGINES[name] if isinstance(name, str) else name)(spec.build(seed=0))
    peaks = []  # whole run (construction and warmup), then steady state
    for start, count in ((0, warmup), (warmup, steps)):
        for s in range(start, start + count):
            run_window(engine, spec, rank, s, 1)
        peaks.append(status_kib("VmHWM"))
        dist.barrier()
        reset_peak_rss()
    return {"peak_mib": (peaks[1] - base) / 1024, "whole_run_peak_mib": (max(peaks) - base) / 1024}
