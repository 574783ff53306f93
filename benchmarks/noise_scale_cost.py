"""What GradientAccumulator(noise_scale=True) costs: the same ranks, windows alternating, against it off.

    python benchmarks/noise_scale_cost.py       # -> results/noise_scale_cost.{md,json}, about a minute

Three engines on identical model copies (an MLP of 8.4M parameters, 8 x 1024, AdamW) in the same
2 forked gloo ranks: ``off``, ``off-again`` (a second copy: the A/A pair, the noise) and
``noise_scale`` (each rank squares every bucket as it launches; its norm rides in the control).
Each round runs one window of each, in a seeded shuffled order; a window's time is the maximum
over ranks, and the ratios are paired round by round. Two whole runs, to see whether they agree.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import gradsync
from gradsync.tools.launch import run_ranks

ENGINES = {"off": False, "off-again": False, "noise_scale": True}


def rank_fn(rank, world, reps, warmup, accum, width=1024):
    torch.set_num_threads(1)
    engines = {}
    for name, noise in ENGINES.items():
        torch.manual_seed(0)
        net = torch.nn.Sequential(*[m for _ in range(8) for m in (torch.nn.Linear(width, width), torch.nn.Tanh())])
        model = gradsync.DistributedDataParallel(net, straggler_warning=False)
        acc = gradsync.GradientAccumulator(model, steps=accum, noise_scale=noise)
        engines[name] = (model, acc, acc.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-5)))
    g = torch.Generator().manual_seed(rank)
    times = {n: [] for n in engines}
    for rep in range(warmup + reps):
        order = list(engines)
        random.Random(rep).shuffle(order)  # the same order on every rank
        for name in order:
            model, acc, optimizer = engines[name]
            dist.barrier()
            start = time.perf_counter()
            for _ in range(accum):
                with acc.accumulate():
                    acc.backward(model(torch.randn(32, width, generator=g)).square().mean())
                optimizer.step()
                optimizer.zero_grad()
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if rep >= warmup:
                times[name].append(float(took))
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("--stem", default="noise_scale_cost")
    p.add_argument("--width", type=int, default=1024, help="the MLP's width (smaller: a smoke test)")
    args = p.parse_args()
    runs = []
    for run in range(args.runs):
        load = os.getloadavg()[0]
        times = run_ranks(rank_fn, 2, args.reps, args.warmup, args.accum, args.width, timeout=900)[0]
        paired = {n: statistics.median(a / b for a, b in zip(times[n], times["off"])) for n in ("off-again", "noise_scale")}
        runs.append({"load": load, "median_ms": {n: statistics.median(t) * 1e3 for n, t in times.items()},
                     "paired": paired, "noise_ratios": [a / b for a, b in zip(times["noise_scale"], times["off"])]})
        print(f"run {run + 1}: noise_scale/off {paired['noise_scale']:.3f}, A/A {paired['off-again']:.3f}, "
              f"load {load:.1f}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.stem}.json").write_text(json.dumps(runs, indent=1))
    lines = ["# GradientAccumulator(noise_scale=True): cost against it off", "",
             f"`python benchmarks/noise_scale_cost.py`, {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores; "
             f"2 gloo ranks, MLP 8.4M parameters, windows of {args.accum} micro-steps, {args.reps} rounds per run, "
             "engines alternating in a shuffled order; paired medians of per-round ratios.", "",
             "| run | load | off ms | off-again ms | noise_scale ms | A/A (off-again/off) | noise_scale/off |",
             "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(runs):
        m = r["median_ms"]
        lines.append(f"| {i + 1} | {r['load']:.1f} | {m['off']:.1f} | {m['off-again']:.1f} | {m['noise_scale']:.1f} | "
                     f"{r['paired']['off-again']:.3f} | {r['paired']['noise_scale']:.3f} |")
    lines.append("")
    (args.out / f"{args.stem}.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
