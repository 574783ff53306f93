"""Sharded training side by side: gradsync's ShardedDataParallel against torch's DDP, ZeRO and FSDP2.

Same model, data and AdamW for every engine; engines take turns window by window (the order
is shuffled each round) and ratios to torch's DDP are paired round by round. Memory: peak RSS per
rank over steady-state steps, each engine alone in fresh processes (as ``measure.memory_rank``).

    python benchmarks/sharded_speed.py [--reps 11] [--quick]   # -> results/sharded_speed.{json,md}
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import gradsync
from gradsync.tools.bench.measure import _mmap_large_allocations, reset_peak_rss, round_order, status_kib
from gradsync.tools.bench.models import ModelSpec, loss_fn
from gradsync.tools.bench.run import machine_info
from gradsync.tools.launch import run_ranks

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = [ModelSpec(name="mlp-8.4M", kind="mlp", width=1024, depth=8, batch=32),
          ModelSpec(name="gpt-12M", kind="gpt", width=384, depth=6, batch=2, seq=64)]
QUICK = [ModelSpec(name="mlp-tiny", kind="mlp", width=64, depth=2, batch=4)]
LR = 1e-3


class Engine:
    """``micro_step(x, y, sync)`` then ``step()``, for one implementation on its own model copy."""

    def __init__(self, module: nn.Module):
        self.model, self.opt = self.build(module)

    def micro_step(self, x, y, sync: bool) -> None:
        if sync:
            loss_fn(self.model(x), y).backward()
        else:
            with self.model.no_sync():
                loss_fn(self.model(x), y).backward()

    def step(self) -> None:
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


def add_before(src: str) -> None:
    """Add engine ``sharded-before``: ShardedDataParallel from another checkout's ``src/gradsync``
    (e.g. ``git archive <commit> src | tar -x -C /tmp/old``), imported as ``gradsync_before``."""
    import shutil
    import sys
    import tempfile
    root = tempfile.mkdtemp(prefix="gradsync-before-")
    shutil.copytree(Path(src) / "gradsync", Path(root) / "gradsync_before")  # its imports are relative
    sys.path.insert(0, root)
    import gradsync_before  # noqa: PLC0415

    class Before(Engine):
        def build(self, module):
            model = gradsync_before.ShardedDataParallel(module)
            return model, gradsync_before.ShardedOptimizer(model, torch.optim.AdamW, lr=LR)
    ENGINES["sharded-before"] = Before


def _window(engine: Engine, spec: ModelSpec, rank: int, step: int, accum: int) -> None:
    for k in range(accum):
        x, y = spec.batch_for(rank, step * accum + k)
        engine.micro_step(x, y, sync=k == accum - 1)
    engine.step()


def _max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _build(names: list[str], spec: ModelSpec) -> tuple[dict[str, Engine], dict[str, str]]:
    base = spec.build(seed=0)
    engines, failed = {}, {}
    for name in names:
        try:
            engines[name] = ENGINES[name](copy.deepcopy(base))
        except Exception as exc:  # noqa: BLE001  (recorded in the results: why it cannot run here)
            failed[name] = f"{type(exc).__name__}: {exc}"[:400]
    return engines, failed


def time_rank(rank, world, spec, names, accum, warmup, reps) -> dict:
    torch.set_num_threads(1)
    engines, failed = _build(names, spec)
    for name in list(engines):  # a first window each: an engine failing here is reported, not timed
        try:
            _window(engines[name], spec, rank, 0, accum)
        except Exception as exc:  # noqa: BLE001
            failed[name] = f"{type(exc).__name__}: {exc}"[:400]
            del engines[name]
    order = list(engines)
    times = {n: [] for n in order}
    for rep in range(warmup + reps):
        for name in round_order(order, rep):
            dist.barrier()
            start = time.perf_counter()
            _window(engines[name], spec, rank, rep + 1, accum)
            wall = _max(time.perf_counter() - start)
            if rep >= warmup:
                times[name].append(wall)
    final = {n: sum(p.detach().double().sum().item() for p in e.model.parameters()) for n, e in engines.items()}
    return {"times": times, "failed": failed, "param_sums": final}


def memory_rank(rank, world, spec, name, warmup, steps) -> dict:
    torch.set_num_threads(1)
    _mmap_large_allocations()
    warm = nn.Linear(8, 8)
    warm(torch.randn(2, 8)).sum().backward()
    dist.all_reduce(warm.weight.grad)
    del warm
    gc.collect()
    base = status_kib("VmRSS")
    reset_peak_rss()
    engine = ENGINES[name](spec.build(seed=0))
    peaks = []  # whole run (construction and warmup), then steady state
    for start, count in ((0, warmup), (warmup, steps)):
        for s in range(start, start + count):
            _window(engine, spec, rank, s, 1)
        peaks.append(status_kib("VmHWM"))
        dist.barrier()
        reset_peak_rss()
    return {"peak_mib": (peaks[1] - base) / 1024, "whole_run_peak_mib": (max(peaks) - base) / 1024}


def summarize(times: dict[str, list[float]]) -> dict:
    ref = times["torch-ddp"]
    def pair(t):
        return sorted(a / b for a, b in zip(t, ref))
    out = {"median_ms": {n: 1e3 * statistics.median(t) for n, t in times.items()},
           "paired_ratio": {n: statistics.median(pair(t)) for n, t in times.items()},
           "ratio_iqr": {n: [pair(t)[len(t) // 4], pair(t)[(3 * len(t)) // 4]] for n, t in times.items()},
           # torch DDP against itself one round later: how much a ratio moves from load alone
           "noise": statistics.median(abs(a / b - 1) for a, b in zip(ref, ref[1:] + ref[:1]))}
    return out


def report(record: dict) -> str:
    names = [n for n in ENGINES if any(n in row["paired_ratio"] or n in row["failed"] for row in record["rows"])]
    lines = [f"# Sharded training side by side ({record['world']} gloo ranks, AdamW)", "",
             f"Machine: {record['machine']['cpu']} ({record['machine']['cores']} cores), torch {record['torch']}; "
             f"load average before {record['load_before'][0]:.1f}, after {record['load_after'][0]:.1f} "
             f"(the benchmark's own ranks included). {record['reps']} paired rounds per row, {record['runs']} runs.", "",
             "Paired ratio to torch's DDP (median over rounds; IQR in brackets), and median window time:", "",
             "| model | accum | run | noise | " + " | ".join(names) + " |",
             "|---|---|---|---|" + "---|" * len(names)]
    for row in record["rows"]:
        cells = []
        for n in names:
            if n in row["paired_ratio"]:
                lo, hi = row["ratio_iqr"][n]
                cells.append(f"{row['paired_ratio'][n]:.3f} [{lo:.2f}-{hi:.2f}] {row['median_ms'][n]:.0f} ms")
            else:
                cells.append("n/a")
        lines.append(f"| {row['model']} | {row['accum']} | {row['run']} | ±{100 * row['noise']:.1f}% | "
                     + " | ".join(cells) + " |")
    failed = {(n, why) for row in record["rows"] for n, why in row["failed"].items()}
    if failed:
        lines += ["", "Engines that could not run:", ""] + [f"- {n}: `{why}`" for n, why in sorted(failed)]
    lines += ["", "Peak RSS per rank above the pre-model baseline (MiB; steady state / whole run incl. construction):",
              "", "| model | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for model, per in record["memory"].items():
        lines.append(f"| {model} | " + " | ".join(
            f"{per[n]['peak_mib']:.0f} / {per[n]['whole_run_peak_mib']:.0f}" if isinstance(per.get(n), dict)
            else "n/a" for n in names) + " |")
    return "\n".join(lines) + "\n"


def timing_args(doc: str, warmup: int) -> argparse.ArgumentParser:
    """The options every sharded timing script takes."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--runs", type=int, default=2, help="whole timing runs, to see whether they agree")
    p.add_argument("--accum", type=int, nargs="+", default=[1, 4])
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--quick", action="store_true", help="tiny model, 1 round: a smoke test")
    return p


def main(argv=None) -> dict:
    p = timing_args(__doc__, warmup=2)
    p.add_argument("--engines", nargs="+", default=list(ENGINES))
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--stem", default="sharded_speed", help="results file name")
    p.add_argument("--before", help="an older checkout's src/ directory: adds engine sharded-before")
    args = p.parse_args(argv)
    if args.before:
        add_before(args.before)
    models = QUICK if args.quick else MODELS
    if args.quick:
        args.reps, args.warmup, args.runs = 1, 0, 1
    rows, load_before = [], os.getloadavg()
    for run in range(args.runs):
        for spec in models:
            for accum in args.accum:
                res = run_ranks(time_rank, args.world, spec, args.engines, accum, args.warmup, args.reps,
                                timeout=1800)[0]
                rows.append({"model": spec.name, "accum": accum, "run": run + 1, "failed": res["failed"],
                             "param_sums": res["param_sums"], "load": os.getloadavg()[0], **summarize(res["times"])})
                print(f"run {run + 1} {spec.name} accum {accum}: " + ", ".join(
                    f"{n} {r:.3f}" for n, r in rows[-1]["paired_ratio"].items()), flush=True)
    memory: dict = {}
    for spec in [] if args.no_memory else models:
        memory[spec.name] = {}
        for name in args.engines:
            try:
                per_rank = run_ranks(memory_rank, args.world, spec, name, 1 if args.quick else 2,
                                     1 if args.quick else 3, timeout=900)
                memory[spec.name][name] = max(per_rank, key=lambda m: m["peak_mib"])
            except Exception as exc:  # noqa: BLE001
                memory[spec.name][name] = f"{type(exc).__name__}: {exc}"[:300]
    record = {"machine": machine_info(), "torch": torch.__version__, "world": args.world, "reps": args.reps,
              "warmup": args.warmup, "runs": args.runs, "load_before": load_before, "load_after": os.getloadavg(),
              "rows": rows, "memory": memory}
    return write_record(args, args.stem, record, report)


def write_record(args: argparse.Namespace, stem: str, record: dict, report) -> dict:
    """Write ``record`` and its report to ``args.out`` (``-quick`` files for a smoke test)."""
    args.out.mkdir(parents=True, exist_ok=True)
    stem += "-quick" if args.quick else ""
    (args.out / f"{stem}.json").write_text(json.dumps(record, indent=1))
    (args.out / f"{stem}.md").write_text(report(record))
    print(report(record))
    return record


if __name__ == "__main__":
    main()
