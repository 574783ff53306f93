"""Memory, time and traffic of sharded gradients against DDP, with gradient accumulation.

    python benchmarks/memory/sharded.py           # writes results/memory-sharded-<N>cpu-<date>.{md,json}
    python benchmarks/memory/sharded.py --quick   # a tiny model, prints the table, writes nothing

For W = 2 and 4 local gloo ranks, a 50M-parameter MLP trains with AdamW and ACC micro-steps per
window in three ways: (a) gradsync.DDP with no_sync, (b) ShardedDataParallel with no_sync (one
reduce-scatter per window), (c) ShardedDataParallel syncing every micro-step. Per rank we report
peak RSS above the process's RSS before the model was built (glibc is told to return every
allocation of 1 MiB or more to the OS, so RSS follows live tensors), the tensor bytes we account
(gradients at their peak, optimizer state), the median window time and the bytes handed to
collectives per window. Timings are noisy: the machine's cores are shared.
"""
from __future__ import annotations

import os
import sys

if "MALLOC_MMAP_THRESHOLD_" not in os.environ:  # must be set before the C library starts
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
    os.execv(sys.executable, [sys.executable, *sys.argv])

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

import gradsync  # noqa: E402
from gradsync.tools.bench.harness import (RESULTS, LoadWatch, machine_info, record_stem, reset_peak_rss,  # noqa: E402
                                        status_kib, write_record)
from gradsync.tools.launch import import_before_forking, run_ranks  # noqa: E402

WIDTH, DEPTH = 2048, 12  # 12 x Linear(2048, 2048): 50.4M parameters
ACC, WARMUP, WINDOWS, ROWS = 4, 1, 3, 8
BUCKET_MB = 25.0
MiB = 1 << 20
CONFIGS = ("(a) DDP, no_sync", "(b) sharded, no_sync", "(c) sharded, sync_each_batch")


def build() -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers)


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def run_config(rank: int, world_size: int, config: str) -> dict:
    gc.collect()
    base = status_kib("VmRSS")
    module = build()
    sharded = "sharded" in config
    each_batch = "each_batch" in config
    if sharded:
        model = gradsync.ShardedDataParallel(module, bucket_cap_mb=BUCKET_MB)
        opt = gradsync.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-4, weight_decay=0.1)
        state = opt.optimizer.state
    else:
        model = gradsync.DDP(module, bucket_cap_mb=BUCKET_MB)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
        state = opt.state
    trace = model.enable_comm_trace()
    x = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(rank))
    times, grad_peak, traced_before = [], 0, 0
    for window in range(WARMUP + WINDOWS):
        if window == WARMUP:
            reset_peak_rss()
            traced_before = len(trace)
        start = time.perf_counter()
        for m in range(ACC):
            sync = m == ACC - 1 or each_batch
            with contextlib.nullcontext() if sync else model.no_sync():
                (model(x).square().mean() / ACC).backward()
            local = nbytes(p.grad for p in module.parameters() if p.grad is not None)
            if sharded:
                shards = nbytes(b.grad_shard for b in model.reducer.buckets)
                grad_peak = max(grad_peak, local + shards)
            else:
                grad_peak = max(grad_peak, local + nbytes(b.buffer for b in model.reducer.buckets))
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    peak_rss = status_kib("VmHWM") - base
    params = nbytes(module.parameters())
    if sharded:  # staging buckets (filling, or reduce-scattering) at their peak
        grad_peak += model.reducer.store.peak_staging_bytes
    state_bytes = nbytes(v for st in state.values() for v in st.values() if isinstance(v, torch.Tensor))
    windows_traced = trace[traced_before:]
    reduced = sum(b["bytes"] for it in windows_traced for b in it["buckets"]) / WINDOWS
    gathered = nbytes(b.flat_param for b in model.reducer.buckets) if sharded else 0
    w = world_size
    traffic = (reduced * (w - 1) / w + gathered * (w - 1) / w) if sharded else reduced * 2 * (w - 1) / w
    result = dict(params=params, grads=grad_peak, state=state_bytes, rss=peak_rss * 1024,
                  time=statistics.median(times), payload=reduced + gathered, traffic=traffic,
                  staging=model.reducer.store.peak_staging_bytes if sharded else 0)
    del model, opt, state, module
    return result


def bench(rank: int, world_size: int) -> dict:
    warnings.simplefilter("ignore", FutureWarning)
    # before the first config's start: its optimizer's first step would import torch._dynamo (~78 MiB of
    # RSS here) and count it in that config's peak alone
    import_before_forking()
    return {config: run_config(rank, world_size, config) for config in CONFIGS}


def main(argv: list[str] | None = None) -> None:
    global WIDTH, DEPTH, WARMUP, WINDOWS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a tiny model; print the table, write nothing")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    quick = args.quick
    if quick:  # the ranks are forked after this, so they see the small sizes
        WIDTH, DEPTH, WARMUP, WINDOWS = 64, 2, 0, 1
        import_before_forking()  # --quick: once here for every rank (bench imports it again, a no-op then)
    rows, table, load = [], [], LoadWatch()
    for world_size in (2, 4):
        per_rank = run_ranks(bench, world_size, timeout=900, pg_timeout=300)
        worst = {c: {k: max(r[c][k] for r in per_rank) for k in per_rank[0][c]} for c in CONFIGS}
        ddp = worst[CONFIGS[0]]
        sharded_share = (ddp["params"] + ddp["state"]) / world_size
        for config in CONFIGS:
            r = worst[config]
            table.append({"world": world_size, "config": config, **r})
            used = r["grads"] + r["state"]
            ratios = ("", "")
            if "sharded" in config:
                ratios = (f"{used / (sharded_share + r['staging']):.2f}x",
                          f"{used / (sharded_share + BUCKET_MB * MiB):.2f}x")
            rows.append(f"| {world_size} | {config} | {r['rss'] / MiB:.0f} | {r['grads'] / MiB:.0f} | "
                        f"{r['staging'] / MiB:.0f} | {r['state'] / MiB:.0f} | {used / MiB:.0f} | "
                        f"{ratios[0]} | {ratios[1]} | {r['time']:.2f} | "
                        f"{r['payload'] / MiB:.0f} | {r['traffic'] / MiB:.0f} |")
        print("\n".join(rows[-3:]), flush=True)
    if quick:
        return
    today = datetime.date.today().isoformat()
    nparams = sum(p.numel() for p in build().parameters())
    record = {"scenario": "memory-sharded", "machine": machine_info(), "torch": torch.__version__,
              **load.as_record(), "rows": table}
    write_record(args.out, record_stem("memory-sharded"), record,
        f"# Sharded gradients vs DDP under accumulation ({today}, {platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, gloo)\n\n"
        f"Model: {DEPTH} x Linear({WIDTH}, {WIDTH}) + ReLU, {nparams / 1e6:.1f}M fp32 parameters; AdamW; "
        f"{ACC} micro-steps of {ROWS} rows per rank per window; bucket_cap_mb={BUCKET_MB:g}; "
        f"{WINDOWS} timed windows after {WARMUP} warm-up. Figures are per rank (the largest over ranks). "
        "MiB throughout.\n\n"
        "| W | config | peak RSS above start | grads (accounted peak) | of which staging | "
        "optimizer state | grads + state | vs ideal | vs strict ideal | median window s | "
        "collective payload / window | per-rank ring traffic / window |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
        "- grads (accounted peak): DDP: `.grad` tensors + bucket buffers at their largest; sharded: local "
        "`.grad` at its largest + this rank's fp32 gradient shards + staging (buckets being filled or "
        "reduce-scattered, and the reduce-scatter outputs) at its peak. An upper bound: the terms need "
        "not peak together. Not counted anywhere: the gradient autograd produces for one parameter "
        "before it is accumulated (every configuration has it).\n"
        "- ideal = (one fp32 gradient copy + DDP's optimizer state) / W + the bucket buffers, taken as "
        "the staging measured (one bucket reducing while the next fills: with bucket_cap_mb=25 a "
        "bucket here holds two 16 MiB layers, 32 MiB). strict ideal: the same with one bucket_cap_mb "
        f"({BUCKET_MB:g} MiB) instead. The target is (c) within 1.2x of the ideal.\n"
        "- payload: bytes handed to collectives (DDP: all-reduced buckets; sharded: reduce-scattered "
        "buckets + the all-gathered parameters after the step); ring traffic: what each rank sends in "
        "a ring algorithm (all-reduce 2(W-1)/W, reduce-scatter and all-gather (W-1)/W of the payload). "
        "The small end-of-backward control all-reduce is left out.\n"
        "- Times come from a machine whose cores are shared with other jobs, with more ranks than cores "
        "at W=4: read them as rough.\n")


if __name__ == "__main__":
    main()
