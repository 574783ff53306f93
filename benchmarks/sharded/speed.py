"""Sharded training side by side: gradsync's ShardedDataParallel against torch's DDP, ZeRO and FSDP2.

Same model, data and AdamW for every engine; engines take turns window by window (the order
is shuffled each round) and ratios to torch's DDP are paired round by round. Memory: peak RSS per
rank over steady-state steps, each engine alone in fresh processes (``sharding.memory_rank``).
The engines live in ``gradsync.tools.bench.sharding``.

    python benchmarks/sharded/speed.py [--reps 11] [--quick]   # -> results/sharded-speed-<N>cpu-<date>.{json,md}
"""
from __future__ import annotations

import os
import statistics
from pathlib import Path

import torch

from gradsync.tools.bench.harness import LoadWatch, machine_info, paired, record_stem, timing_parser, write_record
from gradsync.tools.bench.sharding import ENGINES, LR, MODELS, QUICK, Engine, memory_rank, time_rank
from gradsync.tools.launch import run_ranks


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


def summarize(times: dict[str, list[float]]) -> dict:
    ref, out = times["torch-ddp"], paired(times, "torch-ddp")
    # torch DDP against itself one round later: how much a ratio moves from load alone
    out["noise"] = statistics.median(abs(a / b - 1) for a, b in zip(ref, ref[1:] + ref[:1]))
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


def main(argv=None) -> dict:
    p = timing_parser(__doc__, reps=11, warmup=2)
    p.add_argument("--runs", type=int, default=2, help="whole timing runs, to see whether they agree")
    p.add_argument("--engines", nargs="+", default=list(ENGINES))
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--before", help="an older checkout's src/ directory: adds engine sharded-before")
    args = p.parse_args(argv)
    if args.before:
        add_before(args.before)
    models = QUICK if args.quick else MODELS
    if args.quick:
        args.reps, args.warmup, args.runs = 1, 0, 1
    rows, load = [], LoadWatch()
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
    record = {"scenario": "sharded-speed", "machine": machine_info(), "torch": torch.__version__, "world": args.world,
              "reps": args.reps, "warmup": args.warmup, "runs": args.runs, **load.as_record(), "quick": args.quick,
              "rows": rows, "memory": memory}
    write_record(args.out, args.name or record_stem("sharded-speed", args.quick), record, report(record))
    return record


if __name__ == "__main__":
    main()
