"""The profiling pass of ``gradsync bench``: where one optimizer window's time goes, per engine.

It runs after the timed windows, on the same engines, never inside a timed window. Per engine:
wall timers around each forward, each backward (with the engine's end-of-backward waits and
write-back), the naive baseline's collective and division after backward, and the optimizer
step. A second window runs under ``torch.profiler`` (forward excluded), which attributes the
engine's own passes over gradient memory by op and caller: the copy into buckets (with the
division folded in, where it is), a division of its own, and the write-back to ``.grad``. The
same micro-batches through a plain module (no data parallelism) give the backward compute. The
rest of the backward's wall time is *communication exposed + other*: waiting for collectives
after the last gradient, the engine's bookkeeping and the compute slowed by collectives that share
the cores. Communication hidden = the same buckets all-reduced alone, less the exposed part.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from .models import loss_fn

PHASES = ("forward", "backward compute", "bucket copy-in", "division", "write-back",
          "communication exposed + other", "optimizer")
_COUNTED_ELSEWHERE = ("aten::to", "aten::_to_copy", "aten::clone")  # a scalar's cast, or part of a clone


def classify(event) -> str | None:
    """The engine pass a profiled op belongs to, or None (autograd's own work, or not a pass)."""
    callers, e = [], event.cpu_parent
    while e is not None:
        callers.append(e.name)
        e = e.cpu_parent
    if callers and callers[0] in _COUNTED_ELSEWHERE:
        return None
    if event.name == "aten::_foreach_copy_" and not callers:
        return "write-back"  # gradsync without views: one batched copy per bucket (its dtype reads TensorList)
    dtypes = getattr(event, "input_dtypes", None) or [""]
    if dtypes[0] and not any(k in dtypes[0] for k in ("float", "double", "Half", "BFloat16", "complex")):
        return None  # integer tensors: the engines' control messages, not gradients
    if any(c.startswith("autograd::engine::evaluate_function") and "AccumulateGrad" not in c for c in callers):
        return None  # inside a backward function: compute
    in_hook = any("AccumulateGrad" in c for c in callers)  # gradient hooks run under AccumulateGrad
    name = event.name
    if in_hook and name in ("aten::div", "aten::mul", "aten::copy_"):
        return "bucket copy-in"
    if name in ("aten::div_", "aten::mul_", "aten::_foreach_div_"):
        return "division"
    if name in ("aten::copy_", "aten::clone") and (not callers or "copy_bucket_to_grad" in callers[0]):
        return "write-back"  # the end-of-backward callback (torch: copy_bucket_to_grad)
    return None


def _window(engine, spec, rank, step, accum, probe) -> None:
    for k in range(accum):
        x, y = spec.batch_for(rank, step * accum + k)
        engine.micro_step(x, y, sync=k == accum - 1, probe=probe)


def _timers(out: dict):
    @contextlib.contextmanager
    def probe(phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            out[phase] += time.perf_counter() - start
    return probe


def _profiler(out: dict):
    @contextlib.contextmanager
    def probe(phase: str):
        if phase == "forward":  # forward ops (reshapes, scalings) are not passes of the engine
            yield
            return
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            yield
        for event in prof.events():
            kind = classify(event)
            if kind:
                out[kind] += event.cpu_time_total * 1e-6
    return probe


def _plain_backward(spec, rank, step, accum, module) -> float:
    spent = 0.0
    for k in range(accum):
        x, y = spec.batch_for(rank, step * accum + k)
        loss = loss_fn(module(x), y)
        start = time.perf_counter()
        loss.backward()
        spent += time.perf_counter() - start
    module.zero_grad(set_to_none=True)
    return spent


def standalone_allreduce(numels: list[int], reps: int = 3) -> float:
    """Seconds to all-reduce fp32 buffers of these sizes, all in flight at once, with nothing else running."""
    buffers = [torch.zeros(n) for n in numels]
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        for work in [dist.all_reduce(b, async_op=True) for b in buffers]:
            work.wait()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def breakdown(rank, world, spec, engines: dict, accum: int, windows: int = 2) -> dict | None:
    """Rank 0's seconds per window in each of ``PHASES`` per engine, plus hidden communication."""
    names = list(engines)
    walls = {n: defaultdict(float) for n in names}
    plain, compute = spec.build(seed=0), 0.0
    for w in range(windows):
        for name in names[w % len(names):] + names[:w % len(names)]:
            dist.barrier()
            _window(engines[name], spec, rank, 200 + w, accum, _timers(walls[name]))
            start = time.perf_counter()
            engines[name].optimizer_step()
            walls[name]["optimizer"] += time.perf_counter() - start
        compute += _plain_backward(spec, rank, 200 + w, accum, plain)
    passes = {n: defaultdict(float) for n in names}
    for name in names:
        dist.barrier()
        _window(engines[name], spec, rank, 300, accum, _profiler(passes[name]))
        engines[name].optimizer_step()
    buckets = [b.buffer.numel() for b in engines[names[0]].model.reducer.buckets] if "gradsync" in engines else []
    alone = standalone_allreduce(buckets) if buckets else 0.0
    if rank:
        return None
    out = {}
    for name in names:
        wall = {k: v / windows for k, v in walls[name].items()}
        row = {"forward": wall.get("forward", 0.0), "backward compute": compute / windows,
               "optimizer": wall.get("optimizer", 0.0), **{k: passes[name][k] for k in PHASES[2:5]}}
        backward = wall.get("backward", 0.0) + wall.get("collective", 0.0) + wall.get("division", 0.0)
        row["communication exposed + other"] = max(0.0, backward - sum(row[k] for k in PHASES[1:5]))
        row["total"] = wall.get("forward", 0.0) + backward + row["optimizer"]
        row["communication hidden"] = 0.0 if name == "naive" else max(0.0, alone - row["communication exposed + other"])
        out[name] = row
    return {"engines": out, "standalone_allreduce_s": alone, "buckets": len(buckets)}
