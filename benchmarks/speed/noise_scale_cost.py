"""What GradientAccumulator(noise_scale=True) costs: the same ranks, windows alternating, against it off.

    python benchmarks/speed/noise_scale_cost.py   # -> results/speed-noise-scale-cost-<N>cpu-<date>.{md,json}, about a minute

Three engines on identical model copies (an MLP of 8.4M parameters, 8 x 1024, AdamW) in the same
2 forked gloo ranks: ``off``, ``off-again`` (a second copy: the A/A pair, the noise) and
``noise_scale`` (each rank squares every bucket as it launches; its norm rides in the control).
Each round runs one window of each, in a seeded shuffled order; a window's time is the maximum
over ranks, and the ratios are paired round by round. Two whole runs, to see whether they agree.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import gradsync
from gradsync.tools.bench.harness import (RESULTS, LoadWatch, machine_info, paired, record_stem, reduce_max,
                                        round_order, write_record)
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
        for name in round_order(list(engines), rep):  # the same order on every rank
            model, acc, optimizer = engines[name]
            dist.barrier()
            start = time.perf_counter()
            for _ in range(accum):
                with acc.accumulate():
                    acc.backward(model(torch.randn(32, width, generator=g)).square().mean())
                optimizer.step()
                optimizer.zero_grad()
            took = reduce_max([time.perf_counter() - start])[0]
            if rep >= warmup:
                times[name].append(took)
    return times


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--name", help="file name stem (default: speed-noise-scale-cost-<N>cpu-<date>)")
    p.add_argument("--width", type=int, default=1024, help="the MLP's width (smaller: a smoke test)")
    args = p.parse_args(argv)
    runs, watch = [], LoadWatch()
    for run in range(args.runs):
        load = os.getloadavg()[0]
        times = run_ranks(rank_fn, 2, args.reps, args.warmup, args.accum, args.width, timeout=900)[0]
        to_off = paired(times, "off")
        runs.append({"load": load, "median_ms": to_off["median_ms"], "paired_ratio": to_off["paired_ratio"],
                     "noise_ratios": [a / b for a, b in zip(times["noise_scale"], times["off"])]})
        print(f"run {run + 1}: noise_scale/off {to_off['paired_ratio']['noise_scale']:.3f}, "
              f"A/A {to_off['paired_ratio']['off-again']:.3f}, load {load:.1f}", flush=True)
    lines = ["# GradientAccumulator(noise_scale=True): cost against it off", "",
             f"`python benchmarks/speed/noise_scale_cost.py`, {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores; "
             f"2 gloo ranks, MLP 8.4M parameters, windows of {args.accum} micro-steps, {args.reps} rounds per run, "
             "engines alternating in a shuffled order; paired medians of per-round ratios.", "",
             "| run | load | off ms | off-again ms | noise_scale ms | A/A (off-again/off) | noise_scale/off |",
             "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(runs):
        m = r["median_ms"]
        lines.append(f"| {i + 1} | {r['load']:.1f} | {m['off']:.1f} | {m['off-again']:.1f} | {m['noise_scale']:.1f} | "
                     f"{r['paired_ratio']['off-again']:.3f} | {r['paired_ratio']['noise_scale']:.3f} |")
    lines.append("")
    record = {"scenario": "speed-noise-scale-cost", "machine": machine_info(), "accum": args.accum, "reps": args.reps,
              **watch.as_record(), "runs": runs}
    write_record(args.out, args.name or record_stem("speed-noise-scale-cost"), record, "\n".join(lines))
    return record


if __name__ == "__main__":
    main()
