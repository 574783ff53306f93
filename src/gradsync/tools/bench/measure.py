"""What one rank of ``gradsync.tools.bench.run`` measures: step times, bytes, comm timeline, profile, memory.

Every function here runs inside a rank forked by ``gradsync.tools.launch.run_ranks`` and returns plain
picklable data; ``gradsync.tools.bench.run`` turns it into tables and plots.
"""
from __future__ import annotations

import contextlib
import cProfile
import ctypes
import gc
import os
import pstats
import random
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from gradsync.engine.telemetry import chrome_trace
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from .breakdown import breakdown
from .models import TorchEngine, count_params, loss_fn, make_engines

# Collectives gradsync (and the naive baseline) call through ``torch.distributed``, with the bytes
# one rank sends under ring algorithms, per byte of the full tensor: all-reduce 2(W-1)/W,
# reduce-scatter and all-gather (W-1)/W; all-to-all (W-1)/W (the sharded reduce-scatter on CPU);
# broadcast (W-1)/W on average over ranks (W-1 receivers; the sharded all-gather on CPU is W of them).
RING_FACTOR = {"all_reduce": lambda w: 2 * (w - 1) / w, "reduce_scatter_tensor": lambda w: (w - 1) / w,
               "all_gather_into_tensor": lambda w: (w - 1) / w, "broadcast": lambda w: (w - 1) / w,
               "all_to_all_single": lambda w: (w - 1) / w}
# torch 2.13 names for the same two (output first, like the old ones)
for _new, _old in (("reduce_scatter_single", "reduce_scatter_tensor"), ("all_gather_single", "all_gather_into_tensor")):
    if hasattr(dist, _new):
        RING_FACTOR[_new] = RING_FACTOR[_old]


def run_window(engine, spec, rank: int, step: int, accum: int) -> None:
    for k in range(accum):
        x, y = spec.batch_for(rank, step * accum + k)
        engine.micro_step(x, y, sync=k == accum - 1)
    engine.optimizer_step()


def reduce_values(values: list[float], op) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.tolist()


def round_order(names: list[str], rep: int) -> list[str]:
    """The order of round ``rep``: shuffled, the same on every rank (seeded by the round).

    Not a rotation: with one, every engine always follows the same neighbour, and what a window
    leaves behind (freed memory to fault in again, gloo threads still winding down) is charged to
    the engine after it, the same one every round.
    """
    return random.Random(rep).sample(names, len(names))


def time_engines(rank, world, spec, names, accum, warmup, reps, cap) -> dict:
    """Alternate the engines window by window; return each one's wall time (max over ranks) and
    CPU time (this process and its gloo threads, summed over ranks) per window."""
    engines = make_engines(spec, names, bucket_cap_mb=cap)
    return {**alternate(engines, spec, rank, accum, warmup, reps), "engines": engines}


def alternate(engines: dict, spec, rank, accum, warmup, reps) -> dict:
    """Time ``engines`` (name -> engine) window by window in a shuffled order per round; return
    {"times", "cpu"}: each one's wall time (max over ranks) and CPU time (summed) per window."""
    names = list(engines)
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(warmup + reps):
        for name in round_order(names, rep):
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            run_window(engines[name], spec, rank, rep, accum)
            wall, used = time.perf_counter() - start, time.process_time() - cpu_start
            wall = reduce_values([wall], dist.ReduceOp.MAX)[0]
            used = reduce_values([used], dist.ReduceOp.SUM)[0]
            if rep >= warmup:
                times[name].append(wall)
                cpu[name].append(used)
    return {"times": times, "cpu": cpu}


def overhead_rank(rank, world, layers: int = 96, width: int = 8, reps: int = 40) -> dict:
    """Backward time of a model of many tiny parameters, where per-parameter bookkeeping dominates:
    plain module, and each engine with and without communication."""
    from .models import GradsyncEngine, ModelSpec
    spec = ModelSpec(name="tiny-params", kind="mlp", width=width, depth=layers, batch=4)
    base = spec.build()
    variants = {"plain module": base,
                "gradsync": GradsyncEngine(spec.build(), bucket_cap_mb=25, view=False, set_to_none=True, lr=0).model,
                "torch": TorchEngine(spec.build(), bucket_cap_mb=25, view=False, set_to_none=True, lr=0).model}
    x, y = spec.batch_for(rank, 0)
    runs = [("plain module", base, True)] + [(f"{name} {'synced' if sync else 'no_sync'}", model, sync)
                                             for name, model in variants.items() if name != "plain module"
                                             for sync in (False, True)]
    samples: dict[str, list[float]] = {label: [] for label, _, _ in runs}
    for r in range(reps + 3):
        shift = r % len(runs)  # alternate the variants so load changes hit all of them alike
        for label, model, sync in runs[shift:] + runs[:shift]:
            dist.barrier()
            start = time.perf_counter()
            if sync:
                loss_fn(model(x), y).backward()
            else:
                with model.no_sync():
                    loss_fn(model(x), y).backward()
            elapsed = reduce_values([time.perf_counter() - start], dist.ReduceOp.MAX)[0]
            if r >= 3:
                samples[label].append(elapsed)
            for p in model.parameters():
                p.grad = None
    out = {label: sorted(t)[len(t) // 2] for label, t in samples.items()}
    fastest = {label: min(t) for label, t in samples.items()}
    return {"params": sum(1 for _ in base.parameters()), "median_s": out, "min_s": fastest}


@contextlib.contextmanager
def count_collectives(log: list):
    """Record (op, dtype, bytes of the full tensor) of every collective gradsync calls.

    Patches ``torch.distributed`` and any gradsync module that bound a collective to a name of
    its own at import time; every call still goes to the real collective.
    """
    originals = {getattr(dist, op): op for op in RING_FACTOR}
    patched = []

    def counting(op, fn):
        def wrapper(*args, **kwargs):
            # the full tensor: all-reduce's and broadcast's only one, reduce-scatter's input,
            # all-gather's output
            full = args[1] if op.startswith("reduce_scatter") else args[0]
            log.append((op, str(full.dtype), full.numel() * full.element_size()))
            return fn(*args, **kwargs)
        return wrapper

    modules = [dist] + [m for name, m in list(sys.modules.items()) if name.startswith("gradsync") and m]
    for module in modules:
        for attr, value in list(vars(module).items()):
            if callable(value) and value in originals:
                patched.append((module, attr, value))
                setattr(module, attr, counting(originals[value], value))
    try:
        yield log
    finally:
        for module, attr, value in patched:
            setattr(module, attr, value)


def _counting_torch_hook(log: list):
    def hook(state, bucket):
        buf = bucket.buffer()
        log.append(("all_reduce", str(buf.dtype), buf.numel() * buf.element_size()))
        return default_hooks.allreduce_hook(state, bucket)
    return hook


def communication(rank, world, spec, engines, accum, cap, windows: int = 2) -> dict:
    """Bytes each engine hands to collectives per optimizer step, and gradsync's comm trace."""
    grad_bytes = sum(p.numel() * p.element_size() for p in engines["gradsync"].model.parameters())
    out = {"grad_bytes": grad_bytes, "bytes": {}}
    for name, engine in engines.items():
        log: list = []
        if isinstance(engine, TorchEngine):  # torch's reducer calls C++ directly: count through a comm hook
            engine = type(engine)(spec.build(seed=0), bucket_cap_mb=cap, view=None, set_to_none=True, lr=1e-3)
            engine.model.register_comm_hook(None, _counting_torch_hook(log))
            run_window(engine, spec, rank, 0, accum)  # first window: bucket rebuild, not steady state
            log.clear()
            for w in range(windows):
                run_window(engine, spec, rank, w + 1, accum)
        else:
            if name == "gradsync":
                trace = engine.model.enable_comm_trace()
                trace.clear()
            with count_collectives(log):
                for w in range(windows):
                    run_window(engine, spec, rank, w, accum)
            if name == "gradsync":
                out["trace"] = list(trace)
                everyone: list = [None] * world  # every rank's, for the Chrome trace file (run.py writes it)
                dist.all_gather_object(everyone, out["trace"])
                out["chrome_trace"] = chrome_trace(everyone)
                engine.model.reducer.enable_trace(False)
        by_kind: dict[str, float] = defaultdict(float)
        wire = 0.0
        for op, dtype, nbytes in log:
            params = op.startswith(("all_gather", "broadcast"))
            kind = "control" if "float" not in dtype else "parameters" if params else "gradients"
            by_kind[f"{op}:{kind}"] += nbytes / windows
            wire += RING_FACTOR[op](world) * nbytes / windows
        out["bytes"][name] = {"by_op": dict(by_kind), "ring_wire_bytes": wire, "calls": len(log) / windows}
    return out


def profile_gradsync(rank, world, spec, engine, accum, windows: int = 3, top: int = 14) -> dict | None:
    """cProfile ``windows`` optimizer steps of gradsync on rank 0 (other ranks run them plainly)."""
    prof = cProfile.Profile() if rank == 0 else None
    if prof:
        prof.enable()
    for w in range(windows):
        run_window(engine, spec, rank, 100 + w, accum)
    if not prof:
        return None
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    pkg = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))  # gradsync/, less its tools
    tools = os.path.join(pkg, "tools")
    own_total, hook = 0.0, None
    for (filename, line, func), (cc, ncalls, tottime, cumtime, _callers) in stats.stats.items():
        where = f"{os.path.basename(filename)}:{line}({func})" if filename != "~" else func
        rows.append((tottime, cumtime, ncalls, where))
        if filename.startswith(pkg) and not filename.startswith(tools):
            own_total += tottime
            if func == "hook" and os.path.basename(filename) == "reducer.py":
                hook = {"calls": ncalls / windows, "us_per_call": 1e6 * cumtime / max(ncalls, 1)}
    rows.sort(reverse=True)
    return {"total_s": stats.total_tt / windows, "gradsync_self_s": own_total / windows, "hook": hook,
            "params": len(engine.model.reducer.params),
            "top": [{"tottime_ms": 1e3 * t / windows, "cumtime_ms": 1e3 * c / windows,
                     "calls": n / windows, "function": w} for t, c, n, w in rows[:top]]}


def time_engines_plain(rank, world, spec, names, accum, warmup, reps, cap) -> dict:
    """``time_engines`` without the engines (for the size sweep)."""
    timed = time_engines(rank, world, spec, names, accum, warmup, reps, cap)
    model = timed["engines"]["gradsync"].model
    return {"times": timed["times"], "cpu": timed["cpu"], "params": count_params(model.module),
            "buckets": len(model.reducer.buckets)}


def model_rank(rank, world, spec, names, accum, warmup, reps, cap, profile: bool) -> dict:
    """Time the engines side by side, then count bytes, trace and profile (outside the timing)."""
    timed = time_engines(rank, world, spec, names, accum, warmup, reps, cap)
    engines = timed.pop("engines")
    result = {"times": timed["times"], "cpu": timed["cpu"], "params": count_params(engines["gradsync"].model.module)}
    result.update(communication(rank, world, spec, engines, accum, cap))
    if profile:
        result["profile"] = profile_gradsync(rank, world, spec, engines["gradsync"], accum)
        result["breakdown"] = breakdown(rank, world, spec, engines, accum)
    return result


# ---------------------------------------------------------------- memory
def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM (the peak resident set) to the current RSS


def mmap_large_allocations() -> None:
    # glibc would otherwise keep freed multi-MB blocks in its heap (its mmap threshold grows up
    # to 32 MiB), and RSS would lag behind the tensors actually alive.
    libc = ctypes.CDLL("libc.so.6")
    M_MMAP_THRESHOLD = -3
    libc.mallopt(M_MMAP_THRESHOLD, 256 * 1024)


def memory_rank(rank, world, spec, engine_name, view, set_to_none, warmup, steps, cap) -> dict:
    """Steady-state and whole-run (construction included) peak RSS above the pre-model baseline."""
    mmap_large_allocations()
    # Pay torch's and gloo's one-time lazy initialization before taking the baseline.
    warm = torch.nn.Linear(8, 8)
    warm(torch.randn(2, 8)).sum().backward()
    dist.all_reduce(warm.weight.grad)
    del warm
    gc.collect()
    base = status_kib("VmRSS")
    reset_peak_rss()  # the whole-run peak includes construction (what a memory limit sees)
    engine = make_engines(spec, [engine_name], bucket_cap_mb=cap, view=view, set_to_none=set_to_none)[engine_name]
    for s in range(warmup):
        run_window(engine, spec, rank, s, 1)
    whole_run = status_kib("VmHWM")
    dist.barrier()
    reset_peak_rss()
    for s in range(steps):
        run_window(engine, spec, rank, warmup + s, 1)
    peak = status_kib("VmHWM")
    params = count_params(engine.model.module if hasattr(engine.model, "module") else engine.model)
    return {"peak_bytes": (peak - base) * 1024, "whole_run_peak_bytes": (max(peak, whole_run) - base) * 1024,
            "param_bytes": params * 4}
