"""``bucket_cap_mb="auto"`` against fixed caps and torch's DDP.

    python benchmarks/speed/auto_cap.py                 # writes results/speed-auto-cap-<N>cpu-<date>.{json,md}
    python benchmarks/speed/auto_cap.py --reps 3 --out /tmp  # a quick look

AdamW on identical model copies, variants taking turns window by window (``paired.py``): torch's
DDP, and gradsync's DDP with gradient views (the recommended settings) at 25 MiB (torch's
default), 4 MiB, and ``"auto"``. Warm-up covers auto's re-plan and its timed candidates (at most
1 + 4 x 5 synced backwards), so every timed window runs with the chosen cap. Paired ratios are
to torch's DDP.
"""
from __future__ import annotations

from gradsync.tools.bench.models import GradsyncEngine, ModelSpec, TorchEngine
from gradsync.tools.bench.harness import describe, paired, run_paired_benchmark, time_variants, with_aa

MODELS = [ModelSpec(name="mlp-8.4M", kind="mlp", width=1024, depth=8, batch=32),
          ModelSpec(name="gpt-12M", kind="gpt", width=384, depth=6, batch=2, seq=64)]


def time_rank(rank, world, spec, accum, warmup, reps) -> dict:
    kw = dict(set_to_none=True, lr=1e-4)
    auto: list[GradsyncEngine] = []

    def make_auto(m):
        auto.append(GradsyncEngine(m, bucket_cap_mb="auto", view=True, **kw))
        return auto[-1]

    variants = {"torch": lambda m: TorchEngine(m, bucket_cap_mb=25.0, view=False, **kw),
                "gradsync 25 MiB": lambda m: GradsyncEngine(m, bucket_cap_mb=25.0, view=True, **kw),
                "gradsync 4 MiB": lambda m: GradsyncEngine(m, bucket_cap_mb=4.0, view=True, **kw),
                "gradsync auto": make_auto}
    times = time_variants(rank, world, spec, with_aa(variants, "torch"), accum, warmup, reps)
    return {"times": times, "choice": auto[0].model.bucket_choice}


def summarize(result: dict) -> dict:
    return {**paired(result["times"], "torch"), "choice": result["choice"]}


def main(argv: list[str] | None = None) -> dict:
    quick = [ModelSpec(name="gpt-tiny", kind="gpt", width=64, depth=1, batch=2, seq=8)]
    return run_paired_benchmark("speed-auto-cap", __doc__, MODELS, quick, time_rank, summarize, report, argv, reps=15, warmup=24,
                       quick_warmup=8)  # gpt-tiny has one layout: chosen at its first synced backward


def report(record: dict) -> str:
    rows = record["rows"]
    names = list(rows[0]["paired_ratio"])
    lines = ["# Automatic bucket cap (`bucket_cap_mb=\"auto\"`)", "",
             describe(record, ", AdamW, gradsync with gradient views") + " Paired ratio = median over rounds of "
             "(variant / torch's DDP); noise = median difference between consecutive windows of torch's DDP; "
             "*torch A/A*: torch's DDP again on its own copy, the ratio noise alone gives.", "",
             "| model | accum | torch window (ms) | noise (ms) | " + " | ".join(names[1:]) + " | auto chose |",
             "|---|---|---|---|" + "---|" * len(names)]
    for r in rows:
        c = r["choice"]
        chose = "none yet" if c is None else f"{c['bucket_cap_mb']:g} MiB ({c['buckets'][c['bucket_cap_mb']]} buckets)"
        lines.append(f"| {r['model']} | {r['accum']} | {r['median_ms']['torch']:.1f} | {r['noise_ms']:.1f} | "
                     + " | ".join(f"{r['paired_ratio'][n]:.3f}" for n in names[1:]) + f" | {chose} |")
    lines += ["", "What auto timed (median synced backward per candidate cap, ms, max over ranks; buckets):", ""]
    for r in rows:
        c = r["choice"]
        if c is not None:
            lines.append(f"- {r['model']} accum {r['accum']}: " + ", ".join(
                f"{cap:g} MiB {ms:.1f} ({c['buckets'][cap]})" for cap, ms in c["measured_ms"].items()))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
