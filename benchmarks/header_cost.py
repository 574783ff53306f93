"""What the phase headers (divergence detection, ``gradsync/core/header.py``) cost per step.

    python benchmarks/header_cost.py                       # 2 ranks, writes results/header_cost.{json,md}
    python benchmarks/header_cost.py --reps 5 --out /tmp   # a quick look

gradsync's DDP with headers, the same model with ``reducer.phase_headers = False`` and torch's
DDP take turns window by window (the order rotates), on identical copies of each model. A synced
backward costs one header (a 3W int64 all-reduce, waited before the first bucket launches), a
training forward of a model with buffers one more (waited before the buffer broadcast). The
difference of the paired windows is the headers' cost; torch's DDP is the yardstick.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from gradsync.tools.bench.measure import _reduce, _window
from gradsync.tools.bench.models import GradsyncEngine, ModelSpec, TorchEngine
from gradsync.tools.bench.run import machine_info
from gradsync.tools.launch import run_ranks

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True, kw_only=True)
class NormedSpec(ModelSpec):
    """The MLP behind a BatchNorm: buffers, so every training forward broadcasts them."""

    def build(self, seed: int = 0) -> nn.Module:
        mlp = super().build(seed)
        return nn.Sequential(nn.BatchNorm1d(self.width), mlp)


MODELS = [ModelSpec(name="mlp-8.4M", kind="mlp", width=1024, depth=8, batch=32),
          ModelSpec(name="gpt-12M", kind="gpt", width=384, depth=6, batch=2, seq=64),
          NormedSpec(name="mlp-8.4M+batchnorm", kind="mlp", width=1024, depth=8, batch=32),
          ModelSpec(name="mlp-tiny (latency-bound)", kind="mlp", width=64, depth=4, batch=4)]


def time_rank(rank, world, spec, accum, warmup, reps) -> dict:
    base = spec.build(seed=0)
    kw = dict(bucket_cap_mb=25.0, view=False, set_to_none=True, lr=1e-3)
    engines = {"headers": GradsyncEngine(copy.deepcopy(base), **kw),
               "no headers": GradsyncEngine(copy.deepcopy(base), **kw),
               "torch": TorchEngine(copy.deepcopy(base), **kw)}
    engines["no headers"].model.reducer.phase_headers = False
    names = list(engines)
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(warmup + reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            start = time.perf_counter()
            _window(engines[name], spec, rank, rep, accum)
            wall = _reduce([time.perf_counter() - start], dist.ReduceOp.MAX)[0]
            if rep >= warmup:
                times[name].append(wall)
    return times


def summarize(times: dict[str, list[float]]) -> dict:
    on, off, ref = times["headers"], times["no headers"], times["torch"]
    return {"median_ms": {n: 1e3 * statistics.median(t) for n, t in times.items()},
            "paired_cost_ms": 1e3 * statistics.median(a - b for a, b in zip(on, off)),
            "paired_ratio_headers_vs_none": statistics.median(a / b for a, b in zip(on, off)),
            "paired_ratio_vs_torch": {n: statistics.median(a / b for a, b in zip(t, ref)) for n, t in times.items()},
            "noise_ms": 1e3 * statistics.median(abs(a - b) for a, b in zip(off, off[1:] + off[:1])),
            "raw": times}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--reps", type=int, default=21)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--accum", type=int, nargs="+", default=[1, 4])
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    rows, load_before = [], os.getloadavg()
    for spec in MODELS:
        for accum in args.accum:
            times = run_ranks(time_rank, args.world, spec, accum, args.warmup, args.reps, timeout=1800)[0]
            row = {"model": spec.name, "accum": accum, **summarize(times)}
            rows.append(row)
            print(f"{spec.name} accum {accum}: headers cost {row['paired_cost_ms']:+.3f} ms/window "
                  f"(ratio {row['paired_ratio_headers_vs_none']:.3f}), median "
                  f"{row['median_ms']['no headers']:.2f} ms", flush=True)
    record = {"machine": machine_info(), "world": args.world, "reps": args.reps, "warmup": args.warmup,
              "load_before": load_before, "load_after": os.getloadavg(), "torch": torch.__version__, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "header_cost.json").write_text(json.dumps(record, indent=1))
    (args.out / "header_cost.md").write_text(report(record))
    print(f"wrote {args.out / 'header_cost.md'}")


def report(record: dict) -> str:
    m = record["machine"]
    lines = [
        "# Phase headers: cost per optimizer window",
        "",
        f"{record['world']} gloo ranks on {m['cpu']} ({m['cores']} cores), torch {record['torch']}, "
        f"{record['reps']} timed windows per variant after {record['warmup']} warm-up, variants "
        f"alternating; load average {record['load_before'][0]:.1f} before, {record['load_after'][0]:.1f} after. "
        "Cost = median over windows of (with headers - without), paired by round; noise = median "
        "difference between consecutive windows of the same variant.",
        "",
        "| model | accum | window, no headers (ms) | headers cost (ms) | ratio | noise (ms) | "
        "gradsync / torch | gradsync without headers / torch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in record["rows"]:
        vs = r["paired_ratio_vs_torch"]
        lines.append(f"| {r['model']} | {r['accum']} | {r['median_ms']['no headers']:.2f} | "
                     f"{r['paired_cost_ms']:+.3f} | {r['paired_ratio_headers_vs_none']:.3f} | {r['noise_ms']:.3f} | "
                     f"{vs['headers']:.3f} | {vs['no headers']:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
