"""What the phase headers (divergence detection, ``gradsync/core/header.py``) cost per step.

    python benchmarks/speed/header_cost.py                 # 2 ranks: results/speed-header-cost-<N>cpu-<date>.{json,md}
    python benchmarks/speed/header_cost.py --reps 5 --out /tmp   # a quick look

gradsync's DDP with headers, the same model with ``reducer.plane.headers = False`` and torch's
DDP, all three with gradient views, take turns window by window (the order is shuffled each round), on identical copies of each model. A synced
backward costs one header (a 3W int64 all-reduce, waited before the first bucket launches), a
training forward of a model with buffers one more (waited before the buffer broadcast). The
difference of the paired windows is the headers' cost; torch's DDP is the yardstick.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from gradsync.tools.bench.models import GradsyncEngine, ModelSpec, TorchEngine
from gradsync.tools.bench.harness import describe, paired, run_paired_benchmark, time_variants


@dataclass(frozen=True, kw_only=True)
class NormedSpec(ModelSpec):
    """The MLP behind a BatchNorm: buffers, so every training forward broadcasts them."""

    def build(self, seed: int = 0) -> nn.Module:
        mlp = super().build(seed)
        return nn.Sequential(nn.BatchNorm1d(self.width), mlp)


MODELS = [ModelSpec(name="mlp-8.4M", kind="mlp", width=1024, depth=8, batch=32),
          ModelSpec(name="gpt-12M", kind="gpt", width=384, depth=6, batch=2, seq=64),
          NormedSpec(name="mlp-8.4M+batchnorm", kind="mlp", width=1024, depth=8, batch=32),
          ModelSpec(name="mlp-tiny (latency-bound)", kind="mlp", width=64, depth=4, batch=4)]


def variants(kw: dict) -> dict:
    def headerless(module):
        engine = GradsyncEngine(module, **kw)
        engine.model.reducer.plane.headers = False
        return engine
    return {"headers": lambda m: GradsyncEngine(m, **kw), "no headers": headerless,
            "torch": lambda m: TorchEngine(m, **kw)}


def time_rank(rank, world, spec, accum, warmup, reps) -> dict:
    kw = dict(bucket_cap_mb=25.0, view=True, set_to_none=True, lr=1e-3)  # views: docs/choosing.md's setting, torch's too
    return time_variants(rank, world, spec, variants(kw), accum, warmup, reps)


def summarize(times: dict[str, list[float]]) -> dict:
    own, vs_torch = paired(times, "no headers"), paired(times, "torch")
    return {"median_ms": own["median_ms"], "paired_cost_ms": own["paired_diff_ms"]["headers"],
            "paired_ratio_headers_vs_none": own["paired_ratio"]["headers"],
            "paired_ratio_vs_torch": vs_torch["paired_ratio"], "paired_ratio": own["paired_ratio"],
            "noise_ms": own["noise_ms"], "raw": times}


def main(argv: list[str] | None = None) -> dict:
    quick = [ModelSpec(name="mlp-tiny", kind="mlp", width=32, depth=2, batch=4),
             NormedSpec(name="mlp-tiny+batchnorm", kind="mlp", width=32, depth=2, batch=4)]
    return run_paired_benchmark("speed-header-cost", __doc__, MODELS, quick, time_rank, summarize, report, argv)


def report(record: dict) -> str:
    lines = [
        "# Phase headers: cost per optimizer window",
        "",
        describe(record, ", gradient views on (gradsync and torch)") + " Cost = median over windows of (with headers - without), paired by round; noise = median "
        "difference between consecutive windows of the same variant.",
        "",
        "| model | accum | window, no headers (ms) | headers cost (ms) | ratio | noise (ms) | "
        "gradsync / torch | gradsync without headers / torch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in record["rows"]:
        vs = r["paired_ratio_vs_torch"]
        lines.append(f"| {r['model']} | {r['accum']} | {r['median_ms']['no headers']:.2f} | "
                     f"{r['paired_cost_ms']:+.3f} | {r['paired_ratio_headers_vs_none']:.3f} | {r['noise_ms']:.3f} | "
                     f"{vs['headers']:.3f} | {vs['no headers']:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
