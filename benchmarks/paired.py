"""Paired timing shared by the benchmark scripts: variants take turns window by window.

Each variant wraps its own deep copy of one model; the order is shuffled every round
(``measure.round_order``), so load drifting during the run hits every variant alike. A window's time is the maximum over ranks.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from gradsync.tools.bench.measure import _reduce, _window, round_order
from gradsync.tools.bench.models import Engine, ModelSpec
from gradsync.tools.bench.run import machine_info
from gradsync.tools.launch import run_ranks

RESULTS = Path(__file__).resolve().parent / "results"


def time_variants(rank: int, world: int, spec: ModelSpec, variants: dict[str, Callable[[nn.Module], Engine]],
                  accum: int, warmup: int, reps: int) -> dict[str, list[float]]:
    """Return each variant's window times (seconds, max over ranks) after ``warmup`` windows."""
    base = spec.build(seed=0)
    engines = {name: make(copy.deepcopy(base)) for name, make in variants.items()}
    names = list(engines)
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(warmup + reps):
        for name in round_order(names, rep):
            dist.barrier()
            start = time.perf_counter()
            _window(engines[name], spec, rank, rep, accum)
            wall = _reduce([time.perf_counter() - start], dist.ReduceOp.MAX)[0]
            if rep >= warmup:
                times[name].append(wall)
    return times


def paired(times: dict[str, list[float]], base: str) -> dict:
    """Medians, ratios to ``base`` paired round by round, and the noise of ``base`` itself."""
    ref = times[base]
    return {"median_ms": {n: 1e3 * statistics.median(t) for n, t in times.items()},
            "paired_ratio": {n: statistics.median(a / b for a, b in zip(t, ref)) for n, t in times.items()},
            "paired_diff_ms": {n: 1e3 * statistics.median(a - b for a, b in zip(t, ref)) for n, t in times.items()},
            "noise_ms": 1e3 * statistics.median(abs(a - b) for a, b in zip(ref, ref[1:] + ref[:1])),
            "raw": times}


def describe(record: dict, setup: str = "") -> str:
    """The sentence every report starts with: machine, torch, repetitions, load."""
    m = record["machine"]
    return (f"{record['world']} gloo ranks on {m['cpu']} ({m['cores']} cores), torch {record['torch']}{setup}, "
            f"{record['reps']} timed windows per variant after {record['warmup']} warm-up, variants "
            f"alternating; load average {record['load_before'][0]:.1f} before, {record['load_after'][0]:.1f} after.")


def main(name: str, doc: str, models: list[ModelSpec], quick_models: list[ModelSpec], time_rank: Callable,
         summarize: Callable[[dict], dict], report: Callable[[dict], str], argv: list[str] | None = None,
         reps: int = 21, warmup: int = 3, quick_warmup: int = 1) -> dict:
    """The scripts' command line: time ``models`` x accumulations, write results/<name>.{json,md}."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--reps", type=int, default=reps)
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--accum", type=int, nargs="+", default=[1, 4])
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--quick", action="store_true", help="tiny models, 1 window: a smoke test, not a measurement")
    args = p.parse_args(argv)
    if args.quick:
        args.reps, args.warmup, models = 1, quick_warmup, quick_models
    rows, load_before = [], os.getloadavg()
    for spec in models:
        for accum in args.accum:
            times = run_ranks(time_rank, args.world, spec, accum, args.warmup, args.reps, timeout=1800)[0]
            rows.append({"model": spec.name, "accum": accum, **summarize(times)})
            print(f"{spec.name} accum {accum}: " + ", ".join(
                f"{n} {r:.3f}" for n, r in rows[-1]["paired_ratio"].items()), flush=True)
    record = {"machine": machine_info(), "world": args.world, "reps": args.reps, "warmup": args.warmup,
              "load_before": load_before, "load_after": os.getloadavg(), "torch": torch.__version__, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(record, indent=1))
    (args.out / f"{name}.md").write_text(report(record))
    print(f"wrote {args.out / name}.md")
    return record
