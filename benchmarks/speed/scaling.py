"""Step time at 1, 2 and 4 ranks, and the bytes each rank sends per step against the ring minimum.

    python benchmarks/speed/scaling.py                      # results/speed-scaling-<N>cpu-<date>.{json,md}
    python benchmarks/speed/scaling.py --worlds 2 --reps 5 --out /tmp   # a quick look

Weak scaling: every rank keeps the same micro-batch, so ideal scaling keeps the step time flat.
gradsync's DDP (gradient views), torch's DDP and gradsync with the two bf16 hooks take turns
window by window on identical model copies. Bytes are what the kernel was handed to send:
the growth of ``wchar`` in ``/proc/self/io`` (every thread of the rank, gloo's included) over a
few windows of one variant, divided by the windows. A ring all-reduce sends 2(W-1)/W times the
gradient's bytes per rank, the minimum for fp32 gradients; the bf16 hooks send half of it.
"""
from __future__ import annotations


import torch.distributed as dist

import gradsync
from gradsync.tools.bench.harness import (LoadWatch, machine_info, paired, record_stem, run_window, time_variants,
                                        timing_parser, write_record)
from gradsync.tools.bench.models import GradsyncEngine, ModelSpec, TorchEngine, count_params
from gradsync.tools.launch import import_before_forking, run_ranks

MODELS = [ModelSpec(name="mlp-8.4M", kind="mlp", width=1024, depth=8, batch=32),
          ModelSpec(name="gpt-12M", kind="gpt", width=384, depth=6, batch=2, seq=64)]
QUICK = [ModelSpec(name="mlp-tiny", kind="mlp", width=32, depth=2, batch=4)]
KW = dict(bucket_cap_mb=25.0, view=None, set_to_none=True, lr=1e-3)  # view None: each engine's own


def hooked(hook):
    def make(module):
        engine = GradsyncEngine(module, **KW)
        engine.model.register_comm_hook(None, hook)
        return engine
    return make


VARIANTS = {"gradsync": lambda m: GradsyncEngine(m, **KW), "torch": lambda m: TorchEngine(m, **KW),
            "gradsync bf16_compress_hook": hooked(gradsync.bf16_compress_hook),
            "gradsync bf16_wire_hook": hooked(gradsync.bf16_wire_hook)}


def sent_bytes() -> int:
    """Bytes this process (all its threads) passed to write-like system calls, sockets included."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar:")).split()[1])


def time_rank(rank, world, spec, accum, warmup, reps, byte_windows=3) -> dict:
    times = time_variants(rank, world, spec, VARIANTS, accum, warmup, reps)
    sent = {}
    for name, make in VARIANTS.items():  # bytes one variant at a time, after a warm-up window
        engine = make(spec.build(seed=0))
        run_window(engine, spec, rank, 0, accum)
        dist.barrier()
        before = sent_bytes()
        for step in range(byte_windows):
            run_window(engine, spec, rank, step + 1, accum)
        sent[name] = (sent_bytes() - before) / byte_windows
        dist.barrier()
    return {"times": times, "sent": sent, "grad_bytes": 4 * count_params(spec.build(seed=0))}


def main(argv: list[str] | None = None) -> dict:
    p = timing_parser(__doc__, reps=15, accum=(1,))
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    args = p.parse_args(argv)
    args.accum = args.accum[0]
    models = MODELS
    if args.quick:
        args.reps, args.warmup, models = 1, 1, QUICK
        import_before_forking()  # --quick only: measured runs leave the ranks as they were
    rows, load = [], LoadWatch()
    for spec in models:
        for world in args.worlds:
            ranks = run_ranks(time_rank, world, spec, args.accum, args.warmup, args.reps, timeout=1800)
            own = paired(ranks[0]["times"], "gradsync")
            vs_torch = paired(ranks[0]["times"], "torch")
            rows.append({"model": spec.name, "world": world, "grad_bytes": ranks[0]["grad_bytes"],
                         "median_ms": own["median_ms"], "paired_vs_gradsync": own["paired_ratio"],
                         "paired_vs_torch": vs_torch["paired_ratio"], "noise_ms": own["noise_ms"],
                         "sent_per_rank": {n: max(r["sent"][n] for r in ranks) for n in VARIANTS},
                         "raw": own["raw"]})
            print(f"{spec.name} W={world}: " + ", ".join(f"{n} {t:.1f} ms" for n, t in own["median_ms"].items()),
                  flush=True)
    record = {"scenario": "speed-scaling", "machine": machine_info(), "accum": args.accum, "reps": args.reps,
              "warmup": args.warmup, **load.as_record(), "quick": args.quick, "rows": rows}
    write_record(args.out, args.name or record_stem("speed-scaling", args.quick), record, report(record))
    return record


def report(record: dict) -> str:
    m = record["machine"]
    lines = [
        "# Scaling over ranks, and bytes sent per rank",
        "",
        f"gloo ranks on {m['cpu']} ({m['cores']} cores, one thread per rank), torch {m.get('torch', '')}, "
        f"accumulation {record['accum']}, AdamW, 25 MB buckets; {record['reps']} timed windows per variant after "
        f"{record['warmup']} warm-up, variants alternating; load average {record['load_before'][0]:.1f} before, "
        f"{record['load_after'][0]:.1f} after. Every rank keeps the same micro-batch (weak scaling). "
        f"4 ranks oversubscribe the {m['cores']} cores: their step time measures contention, not the algorithm.",
        "",
        "## Step time (median ms; paired ratio to gradsync's DDP in brackets)",
        "",
        "| model | ranks | " + " | ".join(VARIANTS) + " | gradsync / torch (paired) | noise ms |",
        "|---|---|" + "---|" * len(VARIANTS) + "---|---|",
    ]
    for r in record["rows"]:
        cells = [f"{r['median_ms'][n]:.1f} ({r['paired_vs_gradsync'][n]:.3f})" for n in VARIANTS]
        lines.append(f"| {r['model']} | {r['world']} | " + " | ".join(cells) +
                     f" | {r['paired_vs_torch']['gradsync']:.3f} | {r['noise_ms']:.1f} |")
    lines += [
        "",
        "## Bytes sent per rank per optimizer step (MB; x the ring minimum for fp32 gradients in brackets)",
        "",
        "Ring minimum: 2(W-1)/W x the fp32 gradient. gradsync's small control messages (the phase header, "
        "the end-of-backward check) and the TCP framing are included in its count.",
        "",
        "| model | ranks | gradient MB | ring minimum MB | " + " | ".join(VARIANTS) + " |",
        "|---|---|---|---|" + "---|" * len(VARIANTS),
    ]
    for r in record["rows"]:
        minimum = 2 * (r["world"] - 1) / r["world"] * r["grad_bytes"]
        cells = [f"{r['sent_per_rank'][n] / 1e6:.2f}" + (f" ({r['sent_per_rank'][n] / minimum:.3f})" if minimum else "")
                 for n in VARIANTS]
        lines.append(f"| {r['model']} | {r['world']} | {r['grad_bytes'] / 1e6:.1f} | {minimum / 1e6:.1f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
