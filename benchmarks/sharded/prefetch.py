"""``ShardedOptimizer(prefetch=True)`` against ``prefetch=False`` and torch's DDP.

Prefetch lets ``step()`` return while the parameter all-gathers run, and the next forward waits
for each bucket at first use. Alternating engines window by window (as ``sharded/speed.py``
does) would let those all-gathers finish for free while another engine runs, so here each engine
runs a block of consecutive windows, timed through ``wait_for_params()`` at the block's end:
the time a training loop of that many windows takes. Blocks take turns in a shuffled order
each round; ratios are paired round by round.

    python benchmarks/sharded/prefetch.py [--reps 11] [--block 4]   # -> results/sharded-prefetch-<N>cpu-<date>.{json,md}
"""
from __future__ import annotations

import copy
import os
import statistics
import time

import torch
import torch.distributed as dist

import gradsync
from gradsync.tools.bench.harness import (LoadWatch, machine_info, record_stem, reduce_max, round_order, run_window,
                                        timing_parser, write_record)
from gradsync.tools.bench.sharding import LR, MODELS, QUICK, Engine, TorchDDP
from gradsync.tools.launch import import_before_forking, run_ranks


class Sharded(Engine):
    prefetch = False

    def build(self, module):
        model = gradsync.ShardedDataParallel(module)
        return model, gradsync.ShardedOptimizer(model, torch.optim.AdamW, lr=LR, prefetch=self.prefetch)

    def finish(self) -> None:
        self.opt.wait_for_params()


class ShardedPrefetch(Sharded):
    prefetch = True


ENGINES = {"torch-ddp": TorchDDP, "sharded": Sharded, "sharded-prefetch": ShardedPrefetch}


def time_rank(rank, world, spec, accum, block, warmup, reps) -> dict:
    torch.set_num_threads(1)
    base = spec.build(seed=0)
    engines = {name: cls(copy.deepcopy(base)) for name, cls in ENGINES.items()}
    order = list(engines)
    times: dict[str, list[float]] = {n: [] for n in order}
    step = {n: 0 for n in order}
    for rep in range(warmup + reps):
        for name in round_order(order, rep):
            engine = engines[name]
            dist.barrier()
            start = time.perf_counter()
            for _ in range(block):
                run_window(engine, spec, rank, step[name], accum)
                step[name] += 1
            getattr(engine, "finish", lambda: None)()
            wall = reduce_max([time.perf_counter() - start])[0] / block
            if rep >= warmup:
                times[name].append(wall)
    sums = {n: sum(p.detach().double().sum().item() for p in e.model.parameters()) for n, e in engines.items()}
    return {"times": times, "param_sums": sums}


def summarize(times: dict[str, list[float]]) -> dict:
    def ratio(name, ref):
        return statistics.median(a / b for a, b in zip(times[name], times[ref]))
    ref = times["torch-ddp"]
    return {"median_ms": {n: 1e3 * statistics.median(t) for n, t in times.items()},
            "ratio_to_torch": {n: ratio(n, "torch-ddp") for n in times},
            "prefetch_to_sharded": ratio("sharded-prefetch", "sharded"),
            # torch's DDP against itself one round later: how much a ratio moves from load alone
            "noise": statistics.median(abs(a / b - 1) for a, b in zip(ref, ref[1:] + ref[:1]))}


def report(record: dict) -> str:
    names = list(ENGINES)
    lines = [f"# Sharded parameter prefetch ({record['world']} gloo ranks, AdamW)", "",
             f"Machine: {record['machine']['cpu']} ({record['machine']['cores']} cores), torch {record['torch']}; "
             f"load average before {record['load_before'][0]:.1f}, after {record['load_after'][0]:.1f} "
             f"(the benchmark's own ranks included). Each engine runs {record['block']} consecutive windows per "
             f"turn, timed through `wait_for_params()`; {record['reps']} paired rounds per row after "
             f"{record['warmup']} warm-up rounds.", "",
             "Per-window time (median ms) and paired ratio to torch's DDP; last column: prefetch / no prefetch.", "",
             "| model | accum | run | noise | " + " | ".join(names) + " | prefetch / sharded |",
             "|---|---|---|---|" + "---|" * (len(names) + 1)]
    for row in record["rows"]:
        cells = [f"{row['ratio_to_torch'][n]:.3f} ({row['median_ms'][n]:.0f} ms)" for n in names]
        lines.append(f"| {row['model']} | {row['accum']} | {row['run']} | ±{100 * row['noise']:.1f}% | "
                     + " | ".join(cells) + f" | {row['prefetch_to_sharded']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = timing_parser(__doc__, reps=11, warmup=1)
    p.add_argument("--runs", type=int, default=2, help="whole timing runs, to see whether they agree")
    p.add_argument("--block", type=int, default=4, help="consecutive windows per engine turn")
    args = p.parse_args(argv)
    models = QUICK if args.quick else MODELS
    if args.quick:
        args.reps, args.warmup, args.runs, args.block = 1, 0, 1, 2
        import_before_forking()  # --quick only: measured runs leave the ranks as they were
    rows, load = [], LoadWatch()
    for run in range(args.runs):
        for spec in models:
            for accum in args.accum:
                res = run_ranks(time_rank, args.world, spec, accum, args.block, args.warmup, args.reps,
                                timeout=1800)[0]
                rows.append({"model": spec.name, "accum": accum, "run": run + 1, "param_sums": res["param_sums"],
                             "load": os.getloadavg()[0], **summarize(res["times"])})
                print(f"run {run + 1} {spec.name} accum {accum}: prefetch/sharded "
                      f"{rows[-1]['prefetch_to_sharded']:.3f}", flush=True)
    record = {"scenario": "sharded-prefetch", "machine": machine_info(), "torch": torch.__version__,
              "world": args.world, "reps": args.reps, "warmup": args.warmup, "block": args.block, "runs": args.runs,
              **load.as_record(), "quick": args.quick, "rows": rows}
    write_record(args.out, args.name or record_stem("sharded-prefetch", args.quick), record, report(record))
    return record


if __name__ == "__main__":
    main()
