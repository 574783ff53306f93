"""Benchmark gradsync against torch's C++ DDP side by side: ``gradsync bench``.

Forks W local gloo ranks and, on identical model copies, data and bucket sizes, alternates
gradsync's DDP, ``torch.nn.parallel.DistributedDataParallel``, a naive per-parameter all-reduce
and (when this gradsync has it) the sharded mode, window by window. It records step time (median,
min, max; ratio to torch) at accumulation 1 and 4, bytes handed to collectives per optimizer step
against the ring all-reduce minimum, how much communication hides behind backward (gradsync's comm
trace), a cProfile of gradsync's Python overhead, a model-size sweep, and steady-state peak memory
with and without ``gradient_as_bucket_view`` under both ``zero_grad`` styles. Writes a markdown
report, a JSON record and PNG plots to ``benchmarks/results/`` named by machine and date.

    gradsync bench                      # full run, about 8 minutes on 2 idle CPU cores
    gradsync bench --quick --out /tmp/b # tiny sizes, about a minute: a smoke test, not a measurement
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from . import measure
from .harness import machine_info
from .models import ModelSpec, available_engines, mlp_for_params
from ..launch import run_ranks


@dataclass(kw_only=True)
class Plan:
    """What one benchmark run measures."""

    models: list[ModelSpec]
    accums: list[int] = field(default_factory=lambda: [1, 4])
    sweep: list[ModelSpec] = field(default_factory=list)
    memory_model: ModelSpec | None = None
    bucket_caps: list[float] = field(default_factory=list)  # bucket_cap_mb values for the cap sweep
    warmup: int = 2
    reps: int = 5
    memory_steps: int = 3
    bucket_cap_mb: float = 25.0

    def __post_init__(self):
        if self.warmup < 1 or self.reps < 1:
            raise ValueError("warmup and reps must be at least 1 (the first window rebuilds buckets)")
        if any(a < 1 for a in self.accums):
            raise ValueError(f"accumulation steps must be >= 1, got {self.accums}")


def full_plan(args) -> Plan:
    return _select(args, Plan(
        models=[ModelSpec(name="mlp-8.4M", kind="mlp", width=1024, depth=8, batch=32),
                ModelSpec(name="gpt-12M", kind="gpt", width=384, depth=6, batch=2, seq=64)],
        sweep=[mlp_for_params(p) for p in args.params],
        memory_model=ModelSpec(name="mlp-50M", kind="mlp", width=2048, depth=12, batch=16),
        bucket_caps=[1, 5, 25, 100],
        warmup=args.warmup or 2, reps=args.reps or 11, bucket_cap_mb=args.bucket_cap_mb))


def quick_plan(args) -> Plan:
    return _select(args, Plan(
        models=[ModelSpec(name="mlp-tiny", kind="mlp", width=64, depth=2, batch=4),
                ModelSpec(name="gpt-tiny", kind="gpt", width=64, depth=1, batch=2, seq=8)],
        accums=[1, 2], sweep=[mlp_for_params(p, depth=2, batch=4) for p in args.params or [2e4, 8e4]],
        memory_model=ModelSpec(name="mlp-tiny", kind="mlp", width=256, depth=2, batch=4),
        bucket_caps=[0.05, 1],
        warmup=args.warmup or 1, reps=args.reps or 2, memory_steps=1, bucket_cap_mb=args.bucket_cap_mb))


def _select(args, plan: Plan) -> Plan:
    if args.models:
        plan.models = [m for m in plan.models if m.kind in args.models]
    if args.accum:
        plan.accums = args.accum
    plan.__post_init__()
    return plan


def summarize(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def timing_summary(raw: dict) -> dict:
    """Medians and spreads, plus ratios to torch paired window by window (robust to load drift)."""
    out = {"times": {n: summarize(t) for n, t in raw["times"].items()},
           "cpu": {n: summarize(t) for n, t in raw["cpu"].items()}, "raw_times": raw["times"]}
    torch_t = raw["times"]["torch"]
    out["paired_ratio"] = {n: statistics.median(a / b for a, b in zip(t, torch_t))
                           for n, t in raw["times"].items()}
    return out


def run_models(plan: Plan, world: int, names: list[str], log) -> list[dict]:
    rows = []
    for spec in plan.models:
        for accum in plan.accums:
            log(f"  {spec.name}, accumulation {accum}: alternating {', '.join(names)}")
            r = run_ranks(measure.model_rank, world, spec, names, accum, plan.warmup, plan.reps,
                          plan.bucket_cap_mb, True, timeout=900)[0]
            r.update(timing_summary(r))
            rows.append({"model": spec.name, "accum": accum, "world": world, **r})
    return rows


def run_sweep(plan: Plan, world: int, names: list[str], log) -> list[dict]:
    rows = []
    for spec in plan.sweep:
        log(f"  sweep {spec.name}")
        r = run_ranks(measure.time_engines_plain, world, spec, names, 1, plan.warmup, plan.reps,
                      plan.bucket_cap_mb, timeout=900)[0]
        rows.append({"model": spec.name, "params": r["params"], **timing_summary(r)})
    return rows


def run_bucket_caps(plan: Plan, world: int, log) -> list[dict]:
    spec = plan.models[-1]  # the transformer, when it is timed
    rows = []
    for cap in plan.bucket_caps:
        log(f"  bucket_cap_mb={cap:g} on {spec.name}: gradsync vs torch")
        r = run_ranks(measure.time_engines_plain, world, spec, ["gradsync", "torch"], 1, plan.warmup,
                      plan.reps, cap, timeout=900)[0]
        rows.append({"model": spec.name, "cap": cap, "buckets": r["buckets"], **timing_summary(r)})
    return rows


def run_memory(plan: Plan, world: int, names: list[str], log) -> list[dict]:
    rows = []
    configs = [(e, view, stn) for e in ("gradsync", "torch") for view in (False, True) for stn in (True, False)]
    if "gradsync-sharded" in names:
        configs += [("gradsync-sharded", False, stn) for stn in (True, False)]
    for engine, view, stn in configs:
        log(f"  memory {engine} gradient_as_bucket_view={view} set_to_none={stn}")
        res = run_ranks(measure.memory_rank, world, plan.memory_model, engine, view, stn, 2,
                        plan.memory_steps, plan.bucket_cap_mb, timeout=900)
        rows.append({"engine": engine, "view": view, "set_to_none": stn,
                     "peak_bytes": max(r["peak_bytes"] for r in res),
                     "whole_run_peak_bytes": max(r["whole_run_peak_bytes"] for r in res),
                     "grad_bytes": res[0]["param_bytes"]})
    return rows


def parse_size(text: str) -> float:
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([kKmMgG]?)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (use e.g. 4M, 250k, 1e6)")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2).lower()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="gradsync bench", description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2, help="local gloo ranks (default 2)")
    p.add_argument("--quick", action="store_true", help="tiny models and few repetitions (smoke test)")
    p.add_argument("--params", type=lambda s: [parse_size(x) for x in s.split(",")], default=None,
                   help="model-size sweep, comma separated (default 1M,4M,16M,48M)")
    p.add_argument("--models", type=lambda s: s.split(","), default=None,
                   help="comma separated model kinds to time: mlp,gpt (default both)")
    p.add_argument("--accum", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="accumulation steps to time, comma separated (default 1,4)")
    p.add_argument("--warmup", type=int, default=0, help="warm-up windows per engine (default 2; 1 with --quick)")
    p.add_argument("--reps", type=int, default=0, help="timed windows per engine (default 11; 2 with --quick)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--skip", default="", help="comma separated parts to skip: models,overhead,buckets,sweep,memory")
    p.add_argument("--out", default="benchmarks/results", help="directory for the report and plots")
    args = p.parse_args(argv)
    if args.world < 2:
        p.error("--world must be at least 2: a benchmark of data parallelism needs two ranks")
    if args.models and not set(args.models) <= {"mlp", "gpt"}:
        p.error(f"--models takes mlp and/or gpt, got {','.join(args.models)}")
    if min(args.accum or [1]) < 1 or args.warmup < 0 or args.reps < 0 or args.bucket_cap_mb <= 0 or \
            min(args.params or [1]) < 1:
        p.error("--accum and --params must be at least 1, --warmup and --reps at least 0, --bucket-cap-mb positive")
    unknown = {s for s in args.skip.split(",") if s} - {"models", "overhead", "buckets", "sweep", "memory"}
    if unknown:
        p.error(f"--skip takes models, overhead, buckets, sweep and/or memory, got {','.join(sorted(unknown))}")
    if args.params is None and not args.quick:
        args.params = [1e6, 4e6, 16e6, 48e6]
    return args


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a == "--device" or a.startswith("--device=") for a in argv):  # the GPU benchmark (gpu.py)
        from . import gpu
        return gpu.main(argv)
    from . import report as bench_report
    args = parse_args(argv)
    plan = quick_plan(args) if args.quick else full_plan(args)
    names = [e.name for e in available_engines()]
    skip = {s for s in args.skip.split(",") if s}
    info = machine_info()
    torch.set_num_threads(1)  # each forked rank uses one intra-op thread
    start = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - start:4.0f} s] {msg}", flush=True)  # noqa: E731
    expected = "about a minute" if args.quick else "about 8 minutes (idle)"
    log(f"gradsync bench: {args.world} gloo ranks on {info['cpu']} ({info['cores']} cores), engines: "
        f"{', '.join(names)}; takes {expected} on 2 CPU cores")
    record = {"machine": info, "world": args.world, "quick": args.quick, "engines": names,
              "date": time.strftime("%Y-%m-%d %H:%M"), "bucket_cap_mb": plan.bucket_cap_mb,
              "warmup": plan.warmup, "reps": plan.reps, "optimizer": "AdamW",
              "flush_denormal": True,  # ModelSpec.build flushes them on every rank
              "order": "shuffled"}  # measure.round_order
    record["models"] = [] if "models" in skip else run_models(plan, args.world, names, log)
    if "overhead" not in skip:
        log("  per-parameter overhead: a model of many tiny parameters")
        record["overhead"] = run_ranks(measure.overhead_rank, args.world, *((8, 8, 5) if args.quick else ()),
                                       timeout=600)[0]
    record["buckets"] = [] if "buckets" in skip or not plan.models else run_bucket_caps(plan, args.world, log)
    swept = [n for n in names if n not in ("gradsync-bf16", "torch-views")]
    record["sweep"] = [] if "sweep" in skip else run_sweep(plan, args.world, swept, log)
    record["memory"] = [] if "memory" in skip or plan.memory_model is None else \
        run_memory(plan, args.world, names, log)
    if plan.memory_model is not None:
        record["memory_model"] = plan.memory_model.name
    record["machine"]["load_after"] = os.getloadavg()
    record["seconds"] = time.perf_counter() - start
    stem = f"bench-{info['slug']}-{time.strftime('%Y%m%d-%H%M')}" + ("-quick" if args.quick else "")
    os.makedirs(args.out, exist_ok=True)
    traces = os.path.join(args.out, "traces")  # beside the report, not among it: git ignores benchmarks/results/traces
    for row in record["models"]:  # every rank's comm trace, one Chrome trace file per model and accumulation
        if row.get("chrome_trace"):
            os.makedirs(traces, exist_ok=True)
            with open(os.path.join(traces, f"{stem}-{row['model']}-accum{row['accum']}-trace.json"), "w") as f:
                json.dump(row.pop("chrome_trace"), f)
    with open(os.path.join(args.out, stem + ".json"), "w") as f:
        json.dump(record, f, indent=1)
    path = bench_report.write(record, args.out, stem)
    log(f"wrote {path}")
    print(bench_report.ratio_table(record))
    return record


if __name__ == "__main__":
    main()
