"""torch.compile: torch's DDP + compile against gradsync + compile, step time and overlap (issue 15).

    python benchmarks/speed/compile_bench.py                      # 2 ranks: results/speed-compile-<N>cpu-<date>.{json,md}
    python benchmarks/speed/compile_bench.py --quick --out /tmp  # tiny models, aot_eager: a smoke test

Both wrappers get identical copies of each model, the same data and bucket caps (25 MiB) and are
compiled whole, ``torch.compile(wrapper)``; eager gradsync and eager torch run alongside. The four
take turns window by window (the order is shuffled each round); a ratio is the median over rounds of the paired
window times. Overlap, on separate copies with synced steps (also with a bucket per MLP layer):
the share of bucket communication that ran before the backward's last bucket was ready
(gradsync's comm trace; for torch, its all-reduce hook wrapped to record the same times), and
when the first bucket launched, as a share of the backward call.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch._dynamo
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from gradsync.tools.bench.harness import (LoadWatch, describe, machine_info, paired, record_stem, time_variants,
                                        timing_parser, write_record)
from gradsync.tools.bench.models import GradsyncEngine, ModelSpec, TorchEngine, loss_fn
from gradsync.tools.bench.report import overlap
from gradsync.tools.launch import compile_before_forking, run_ranks
MODELS = [ModelSpec(name="gpt-12M", kind="gpt", width=384, depth=6, batch=2, seq=64),
          ModelSpec(name="mlp-8.4M", kind="mlp", width=1024, depth=8, batch=32)]
KW = dict(view=False, set_to_none=True, lr=1e-3)
OVERLAP = [(MODELS[0], 25.0), (MODELS[1], 25.0), (MODELS[1], 4.0)]  # (model, bucket_cap_mb); 4: a bucket a layer


def variants(backend: str, cap: float = 25.0) -> dict:
    """Both wrappers, eager and compiled whole, as ``harness.time_variants`` builds them."""
    def make(cls, compiled):
        def build(module):
            engine = cls(module, bucket_cap_mb=cap, **KW)
            if compiled:
                engine.model = torch.compile(engine.model, backend=backend)
            return engine
        return build
    return {name + suffix: make(cls, compiled) for name, cls in (("torch", TorchEngine), ("gradsync", GradsyncEngine))
            for compiled, suffix in ((False, ""), (True, "+compile"))}


def time_rank(rank, world, spec, accum, warmup, reps, backend) -> dict:
    torch._dynamo.config.cache_size_limit = 64  # four models' graphs in one process
    return time_variants(rank, world, spec, variants(backend), accum, warmup, reps)


def recording_hook(log: list):
    """torch's averaging all-reduce, recording gradsync's trace fields (torch calls it when ready)."""
    def hook(state, bucket):
        now = time.perf_counter()
        record = {"index": bucket.index(), "ready": now, "launch": now}
        log.append(record)

        def done(fut):
            record["done"] = time.perf_counter()
            return fut.value()
        return default_hooks.allreduce_hook(None, bucket).then(done)
    return hook


def overlap_rank(rank, world, spec, cap, warmup, reps, backend) -> dict:
    out = {}
    for name, make in variants(backend, cap).items():
        engine = make(spec.build(seed=0))
        log: list = []
        if name.startswith("torch"):
            engine.model.register_comm_hook(None, recording_hook(log))
        else:
            trace = engine.model.enable_comm_trace()
        iterations, first_launch = [], []
        for step in range(warmup + reps):
            x, y = spec.batch_for(rank, step)
            loss = loss_fn(engine.model(x), y)
            dist.barrier()
            start, n = time.perf_counter(), len(log)
            loss.backward()
            end = time.perf_counter()
            engine.optimizer_step()
            it = {"buckets": log[n:]} if name.startswith("torch") else trace[-1]
            if step >= warmup:
                iterations.append(it)
                first_launch.append((min(b["launch"] for b in it["buckets"]) - start) / (end - start))
        out[name] = {**overlap(iterations), "first_launch_share": statistics.median(first_launch)}
    return out


def summarize(times: dict[str, list[float]]) -> dict:
    row = paired(times, "torch+compile")
    row["eager_ratio"] = paired(times, "torch")["paired_ratio"]  # every variant against eager torch
    return row


def main(argv: list[str] | None = None) -> None:
    p = timing_parser(__doc__, reps=15)
    p.add_argument("--backend", default="inductor")
    args = p.parse_args(argv)
    models, overlaps = MODELS, OVERLAP
    if args.quick:
        args.reps, args.warmup, args.backend = 1, 2, "aot_eager"
        models = [ModelSpec(name="gpt-tiny", kind="gpt", width=64, depth=1, batch=1, seq=16),
                  ModelSpec(name="mlp-tiny", kind="mlp", width=32, depth=2, batch=4)]
        overlaps = [(models[1], 25.0)]  # torch + compile fails below 1 MiB (its first-bucket assert)
        compile_before_forking(args.backend)  # --quick: its first compile's imports, once, not per rank
    rows, load = [], LoadWatch()
    for spec in models:
        for accum in args.accum:
            times = run_ranks(time_rank, args.world, spec, accum, args.warmup, args.reps, args.backend,
                              timeout=3600)[0]
            rows.append({"model": spec.name, "accum": accum, **summarize(times)})
            print(spec.name, accum, rows[-1]["paired_ratio"], rows[-1]["eager_ratio"], flush=True)
    for spec, cap in overlaps:
        shares = run_ranks(overlap_rank, args.world, spec, cap, args.warmup, args.reps, args.backend, timeout=3600)
        rows.append({"model": spec.name, "bucket_cap_mb": cap, "overlap": shares[0]})
        print(spec.name, cap, "overlap", shares[0], flush=True)
    record = {"scenario": "speed-compile", "machine": machine_info(), "world": args.world, "reps": args.reps,
              "warmup": args.warmup, "backend": args.backend, **load.as_record(), "torch": torch.__version__,
              "quick": args.quick, "rows": rows}
    write_record(args.out, args.name or record_stem("speed-compile", args.quick), record, report(record))


def report(record: dict) -> str:
    lines = [
        "# torch.compile: gradsync + compile against torch's DDP + compile",
        "",
        describe(record, f", backend {record['backend']}, whole wrapper compiled, 25 MiB buckets (timings)")
        + " Ratios: median over rounds of the paired window times.",
        "",
        "| model | accum | torch ms | torch+compile ms | gradsync ms | gradsync+compile ms | "
        "gradsync+compile / torch+compile | gradsync / torch (eager) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in (r for r in record["rows"] if "accum" in r):
        ms = r["median_ms"]
        lines.append(f"| {r['model']} | {r['accum']} | {ms['torch']:.1f} | {ms['torch+compile']:.1f} | "
                     f"{ms['gradsync']:.1f} | {ms['gradsync+compile']:.1f} | "
                     f"{r['paired_ratio']['gradsync+compile']:.3f} | {r['eager_ratio']['gradsync']:.3f} |")
    lines += ["", "Overlap (synced steps, accumulation 1): hidden = share of bucket communication before the "
              "last bucket was ready; first launch = when the first bucket launched, share of the backward call.",
              "", "| model | bucket_cap_mb | variant | buckets | hidden share | exposed ms | first launch |",
              "|---|---|---|---|---|---|---|"]
    for r in (r for r in record["rows"] if "overlap" in r):
        for name, o in r["overlap"].items():
            lines.append(f"| {r['model']} | {r['bucket_cap_mb']:g} | {name} | {o['buckets']} | {o['share']:.2f} | "
                         f"{1e3 * o['exposed_s']:.1f} | {o['first_launch_share']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
