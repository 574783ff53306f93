"""What membership costs per window, measured inside one job: the same model built three ways, windows alternating.

    python benchmarks/elastic/in_job.py                    # sharded, prints a markdown section
    python benchmarks/elastic/in_job.py --ddp --rounds 20  # DistributedDataParallel instead
    python benchmarks/elastic/in_job.py --append benchmarks/results/elastic-recovery-2cpu-2026-11-28.md

One ``gradsync run --replicas 3`` of this file (``--worker``). Every replica builds the same MLP (1.05M parameters,
as ``recovery.py``) three times: on the elastic group (it follows membership), with ``process_group=`` the
same ranks (a plain group: no votes, no mirror), and, sharded, on the plain group with its shards mirrored
(``store.mirror_shards()``: what an elastic sharded model pays for a member that leaves, without the votes).
Each round runs one window of 4 micro-steps of each, in alternating order, between barriers. Pairing the
variants window by window inside one job takes out what separate jobs differ by (placement on the cores,
the machine's load over minutes), which ``recovery.py``'s job pairs include.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEPS = 4


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import gradsync

    gradsync.elastic.init_process_group("gloo", timeout=60)
    me = gradsync.elastic.replica_id()
    torch.set_num_threads(1)
    wrapper = gradsync.DistributedDataParallel if args.ddp else gradsync.ShardedDataParallel

    def build(kind: str):
        torch.manual_seed(0)
        net = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(512, 512), torch.nn.Tanh())])
        model = wrapper(net, **({} if kind == "elastic" else {"process_group": dist.group.WORLD}))
        if kind == "mirrored":
            model.reducer.store.mirror_shards()
        acc = gradsync.GradientAccumulator(model, steps=STEPS)
        inner = torch.optim.SGD(model.parameters(), lr=1e-3) if args.ddp else \
            gradsync.ShardedOptimizer(model, torch.optim.SGD, lr=1e-3)
        return model, acc, acc.wrap_optimizer(inner)

    kinds = ["plain", "elastic"] + ([] if args.ddp else ["mirrored"])
    built = {k: build(k) for k in kinds}
    g = torch.Generator().manual_seed(me)
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(args.rounds + args.warmup):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            model, acc, optimizer = built[kind]
            dist.barrier(group=dist.group.WORLD)
            start = time.perf_counter()
            for _ in range(STEPS):
                with acc.accumulate():
                    acc.backward(model(torch.randn(32, 512, generator=g)).square().mean())
                optimizer.step()
                optimizer.zero_grad()
            dist.barrier(group=dist.group.WORLD)  # the slowest replica's window
            if r >= args.warmup:
                times[kind].append(time.perf_counter() - start)
    Path(args.out, f"{me}.json").write_text(json.dumps(times))


def section(times: dict[str, list[float]], args: argparse.Namespace, load: tuple) -> str:
    what = "DistributedDataParallel" if args.ddp else "ShardedDataParallel + ShardedOptimizer(SGD)"
    lines = [f"## Inside one job: {what} (`benchmarks/elastic/in_job.py{' --ddp' if args.ddp else ''}`)", "",
             f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, load average {load[0]:.1f} before and "
             f"{os.getloadavg()[0]:.1f} after; {args.rounds} rounds after {args.warmup} warm-up, one window of each "
             "variant per round in alternating order; a window is timed between barriers (the slowest replica).", "",
             "| variant | median window (ms) | paired ratio to plain, median [IQR] |", "|---|---|---|"]
    for kind, values in times.items():
        ratios = sorted(a / b for a, b in zip(values, times["plain"]))
        q = statistics.quantiles(ratios, n=4)
        lines.append(f"| {kind} | {statistics.median(values) * 1e3:.1f} | {statistics.median(ratios):.3f} "
                     f"[{q[0]:.3f}-{q[2]:.3f}] |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ddp", action="store_true", help="DistributedDataParallel instead of ShardedDataParallel")
    parser.add_argument("--rounds", type=int, default=80)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--append", type=Path, help="append the section to this results file")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as out:
        extra = ["--ddp"] if args.ddp else []
        cmd = [sys.executable, "-m", "gradsync.tools.cli", "run", "--replicas", "3", __file__, "--worker", "--out", out,
               "--rounds", str(args.rounds), "--warmup", str(args.warmup), *extra]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        if done.returncode != 0:
            raise RuntimeError(f"gradsync run failed:\n{done.stderr[-3000:]}")
        times = json.loads(Path(out, "0.json").read_text())
    text = section(times, args, load)
    print(text)
    if args.append is not None:
        with args.append.open("a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
