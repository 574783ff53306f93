"""``gradsync bench --device cuda``: gradsync against torch's DDP on the GPUs of this machine.

One rank per GPU on NCCL (one GPU: a world of one, where the step shows each engine's own cost
on the host and the device). Per model and accumulation: window times alternating the engines
in a shuffled order per round (paired ratios, medians), the host-device syncs one steady-state
window makes (``torch.cuda.set_sync_debug_mode("warn")`` counts them), and peak device memory.

    gradsync bench --device cuda               # writes benchmarks/results/bench-gpu-<gpu>-<date>.md
    gradsync bench --device cuda --quick       # seconds: a smoke test
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import re
import statistics
import time
import warnings

import torch
import torch.distributed as dist

from gradsync.tools.launch import run_ranks

from .measure import round_order
from .models import GradsyncEngine, ModelSpec, TorchEngine

ENGINES = (GradsyncEngine, TorchEngine)


def plan(quick: bool) -> tuple[list[ModelSpec], list[int], int, int]:
    """Models, accumulations, warm-up and timed windows."""
    if quick:
        return [ModelSpec(name="mlp-tiny", kind="mlp", width=64, depth=2, batch=8)], [1, 2], 1, 3
    return ([ModelSpec(name="mlp-67M", kind="mlp", width=4096, depth=4, batch=64),
             ModelSpec(name="gpt-85M", kind="gpt", width=768, depth=12, batch=16, seq=256)], [1, 4], 3, 21)


def _window(engine, batches, accum: int) -> None:
    for k, (x, y) in enumerate(batches[:accum]):
        engine.micro_step(x, y, sync=k == accum - 1)
    engine.optimizer_step()


def rank_fn(rank: int, world: int, spec: ModelSpec, accum: int, warmup: int, reps: int) -> dict:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    base = spec.build(seed=0).to(device)
    engines = {e.name: e(copy.deepcopy(base), bucket_cap_mb=25, view=None, set_to_none=True, lr=1e-4)
               for e in ENGINES}
    # on the device before timing: a copy from pageable host memory would sync every micro-step
    batches = [tuple(t.to(device) for t in spec.batch_for(rank, k)) for k in range(accum)]
    times: dict[str, list[float]] = {n: [] for n in engines}
    for rep in range(warmup + reps):
        for name in round_order(list(engines), rep):
            torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            _window(engines[name], batches, accum)
            torch.cuda.synchronize()
            wall = torch.tensor([time.perf_counter() - start], device=device)
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)
            if rep >= warmup:
                times[name].append(float(wall))
    syncs, peak = {}, {}
    for name, engine in engines.items():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                _window(engine, batches, accum)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        syncs[name] = host_syncs(str(w.message) for w in caught)
        torch.cuda.synchronize()
        peak[name] = torch.cuda.max_memory_allocated(device)
    return {"times": times, "syncs": syncs, "peak_bytes": peak, "device": torch.cuda.get_device_name(device)}


def host_syncs(messages) -> int:
    """The synchronizing calls among sync-debug warnings: not the one-time notice that the mode is a prototype,
    which names synchronization too and fell on whichever engine was measured first."""
    return sum("called a synchronizing CUDA operation" in m for m in messages)


def paired(times: dict[str, list[float]]) -> dict:
    ratios = [a / b for a, b in zip(times["gradsync"], times["torch"])]
    return {"median_ms": {n: 1e3 * statistics.median(t) for n, t in times.items()},
            "paired_ratio_median": statistics.median(ratios), "paired_ratio_range": [min(ratios), max(ratios)]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="gradsync bench --device cuda", description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda"], required=True)
    p.add_argument("--quick", action="store_true", help="a tiny model and few windows (smoke test)")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    world = torch.cuda.device_count()  # NVML's count: CUDA stays uninitialized here (is_available() would not)
    if world == 0:
        raise SystemExit("gradsync bench --device cuda: no CUDA device here; run `gradsync bench` for the CPU")
    specs, accums, warmup, reps = plan(args.quick)
    record = {"device": "?", "gpus": world, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
              "load_before": os.getloadavg(), "rows": []}
    for spec in specs:
        for accum in accums:
            ranks = run_ranks(rank_fn, world, spec, accum, warmup, reps, backend="nccl", timeout=600)
            record["device"] = ranks[0]["device"]
            row = {"model": spec.name, "accum": accum, **paired(ranks[0]["times"]),
                   "syncs_per_window": ranks[0]["syncs"], "peak_bytes": ranks[0]["peak_bytes"]}
            record["rows"].append(row)
            print(f"{spec.name} accum {accum}: gradsync/torch {row['paired_ratio_median']:.3f}, "
                  f"syncs {row['syncs_per_window']}", flush=True)
    record["load_after"] = os.getloadavg()
    slug = re.sub(r"[^a-z0-9]+", "-", record["device"].lower()).strip("-")
    stem = os.path.join(args.out, f"bench-gpu-{slug}-{time.strftime('%Y%m%d-%H%M')}" + ("-quick" if args.quick else ""))
    os.makedirs(args.out, exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump(record, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(report(record))
    print(f"wrote {stem}.md")
    return record


def report(record: dict) -> str:
    lines = [f"# gradsync bench on {record['device']} x{record['gpus']} (NCCL)", "",
             f"torch {record['torch']}, {record['date']}, host load {record['load_before']} -> "
             f"{record['load_after']}. Window = accumulation micro-steps + AdamW step; engines alternate "
             "in a shuffled order per round; ratio = gradsync / torch per round, median and range.", "",
             "| model | accum | gradsync ms | torch ms | ratio (range) | host syncs per window (gradsync / torch) "
             "| peak MiB (gradsync / torch) |", "|---|---|---|---|---|---|---|"]
    for r in record["rows"]:
        ms, lo_hi, mib = r["median_ms"], r["paired_ratio_range"], {k: v / 2**20 for k, v in r["peak_bytes"].items()}
        lines.append(f"| {r['model']} | {r['accum']} | {ms['gradsync']:.2f} | {ms['torch']:.2f} | "
                     f"{r['paired_ratio_median']:.3f} ({lo_hi[0]:.3f}-{lo_hi[1]:.3f}) | "
                     f"{r['syncs_per_window']['gradsync']} / {r['syncs_per_window']['torch']} | "
                     f"{mib['gradsync']:.0f} / {mib['torch']:.0f} |")
    return "\n".join(lines) + "\n"
