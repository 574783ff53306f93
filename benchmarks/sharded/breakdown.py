"""Where one step of gradsync's sharded engine spends its time (rank-by-rank medians, ms).

Times the engine's own methods by wrapping them, so it runs against any gradsync version
(``PYTHONPATH=<old checkout>/src`` measures the code before a change):

    python benchmarks/sharded/breakdown.py --label before --out /tmp/sharded-breakdown.json
    python benchmarks/sharded/breakdown.py --label after --out /tmp/sharded-breakdown.json  # a second column
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

import gradsync
from gradsync.tools.bench.harness import RESULTS, record_stem
from gradsync.tools.bench.models import ModelSpec, loss_fn
from gradsync.tools.bench.sharding import MODELS, QUICK
from gradsync.tools.launch import run_ranks

PHASES = ["forward", "backward", "  copy into staging", "  launch (divide, issue; folds beyond max_inflight)",
          "  fold (wait + add into shard)", "  end-of-backward check wait", "step", "  inner optimizer",
          "  all-gather wait", "zero_grad"]


def _timed(obj, name: str, key: str, acc: dict) -> None:
    original = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            acc[key] += time.perf_counter() - start
    setattr(obj, name, wrapper)


def breakdown_rank(rank, world, spec: ModelSpec, accum: int, reps: int) -> dict:
    torch.set_num_threads(1)
    acc: dict = defaultdict(float)
    model = gradsync.ShardedDataParallel(spec.build(seed=0))
    opt = gradsync.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    reducer = model.reducer  # its public parts, wrapped on this instance
    _timed(reducer.store, "copy_in", PHASES[2], acc)
    _timed(reducer.launcher, "launch", PHASES[3], acc)
    _timed(reducer.store, "fold", PHASES[4], acc)
    _timed(opt.optimizer, "step", PHASES[7], acc)
    wait = reducer.plane.wait

    def timed_wait(handle, what):
        start = time.perf_counter()
        wait(handle, what)
        key = PHASES[8] if "all-gather" in what else PHASES[4] if what.startswith("bucket") else \
            PHASES[5] if what == "the end-of-backward check" else None
        if key:
            acc[key] += time.perf_counter() - start
    reducer.plane.wait = timed_wait
    samples: dict = defaultdict(list)
    for rep in range(reps + 2):
        acc.clear()
        dist.barrier()
        for k in range(accum):
            x, y = spec.batch_for(rank, rep * accum + k)
            ctx = model.no_sync() if k < accum - 1 else torch.enable_grad()
            with ctx:
                t0 = time.perf_counter()
                loss = loss_fn(model(x), y)
                t1 = time.perf_counter()
                loss.backward()
                acc["forward"] += t1 - t0
                acc["backward"] += time.perf_counter() - t1
        t0 = time.perf_counter()
        opt.step()
        t1 = time.perf_counter()
        opt.zero_grad()
        acc["step"] += t1 - t0
        acc["zero_grad"] += time.perf_counter() - t1
        if rep >= 2:
            for key in PHASES:
                samples[key].append(1e3 * acc.get(key, 0.0))
    return {key: statistics.median(v) for key, v in samples.items()}


def run(models: list[ModelSpec], accum: int, reps: int, world: int = 2) -> dict:
    return {spec.name: run_ranks(breakdown_rank, world, spec, accum, reps, timeout=900) for spec in models}


def table(results: dict[str, dict]) -> list[str]:
    """``results``: label -> model -> per-rank phase dicts; one column per (label, model), rank 0."""
    cols = [(label, model) for label, per in results.items() for model in per]
    lines = ["| phase (ms, rank 0) | " + " | ".join(f"{m} {label}" for label, m in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for key in PHASES:
        lines.append(f"| {key.strip() if not key.startswith(' ') else '&nbsp;&nbsp;' + key.strip()} | "
                     + " | ".join(f"{results[label][m][0].get(key, 0.0):.0f}" for label, m in cols) + " |")
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--label", default="after")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS / f"{record_stem('sharded-breakdown')}.json",
                   help="labels accumulate here")
    p.add_argument("--quick", action="store_true", help="tiny model, 1 step: a smoke test, not a measurement")
    args = p.parse_args(argv)
    models = QUICK if args.quick else MODELS
    if args.quick:
        args.reps = 1
    record = json.loads(args.out.read_text()) if args.out.exists() else {"accum": args.accum, "runs": {}}
    record["runs"].setdefault(args.label, []).append(
        {"reps": args.reps, "load": os.getloadavg(), "results": run(models, args.accum, args.reps)})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    lines = ["# Where a sharded step's time goes (2 gloo ranks, AdamW, accumulation "
             f"{record['accum']}; medians over steps, rank 0)", "",
             "Each column is one run; labels name the code measured. Runs of different labels alternated, on a "
             "shared 2-core machine: compare columns of one model, and expect noise of the size of the spread "
             "between runs of the same label.", ""]
    lines += table({f"{label} #{k + 1}": run_["results"] for label, runs in record["runs"].items()
                    for k, run_ in enumerate(runs)})
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
