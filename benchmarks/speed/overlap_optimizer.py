"""The optimizer overlapped with communication (``gradsync.overlap_optimizer``) against the plain loop.

    python benchmarks/speed/overlap_optimizer.py                 # results/speed-overlap-optimizer-<N>cpu-<date>.{json,md}
    python benchmarks/speed/overlap_optimizer.py --reps 3 --out /tmp  # a quick look

AdamW on identical model copies; variants take turns window by window (``paired.py``): torch's
DDP, gradsync's DDP, gradsync with ``gradient_as_bucket_view=True``, and both of those with the
optimizer stepped bucket by bucket inside the synced backward. Paired ratios are to torch's DDP.
"""
from __future__ import annotations

import torch

import gradsync
from gradsync.tools.bench.models import GradsyncEngine, ModelSpec, TorchEngine
from gradsync.tools.bench.harness import describe, paired, run_paired_benchmark, time_variants, with_aa

MODELS = [ModelSpec(name="mlp-8.4M", kind="mlp", width=1024, depth=8, batch=32),
          ModelSpec(name="gpt-12M", kind="gpt", width=384, depth=6, batch=2, seq=64)]


class AdamW:
    def make_optimizer(self, lr):
        return torch.optim.AdamW(self.model.parameters(), lr=lr)


class TorchAdamW(AdamW, TorchEngine):
    pass


class GradsyncAdamW(AdamW, GradsyncEngine):
    pass


class Overlapped(GradsyncAdamW):
    def make_optimizer(self, lr):
        opt = super().make_optimizer(lr)
        gradsync.overlap_optimizer(self.model, opt)
        return opt


def time_rank(rank, world, spec, accum, warmup, reps) -> dict:
    kw = dict(bucket_cap_mb=25.0, set_to_none=True, lr=1e-4)
    variants = {"torch": lambda m: TorchAdamW(m, view=False, **kw),
                "gradsync": lambda m: GradsyncAdamW(m, view=False, **kw),
                "gradsync + overlap": lambda m: Overlapped(m, view=False, **kw),
                "gradsync views": lambda m: GradsyncAdamW(m, view=True, **kw),
                "gradsync views + overlap": lambda m: Overlapped(m, view=True, **kw)}
    return time_variants(rank, world, spec, with_aa(variants, "torch"), accum, warmup, reps)


def main(argv: list[str] | None = None) -> dict:
    quick = [ModelSpec(name="gpt-tiny", kind="gpt", width=64, depth=1, batch=2, seq=8)]
    return run_paired_benchmark("speed-overlap-optimizer", __doc__, MODELS, quick, time_rank, lambda t: paired(t, "torch"),
                       report, argv, reps=15)


def report(record: dict) -> str:
    rows = record["rows"]
    names = list(rows[0]["paired_ratio"])
    lines = ["# Optimizer overlapped with communication (AdamW)", "",
             describe(record) + " Paired ratio = median over rounds of (variant / torch's DDP); noise = median difference between "
             "consecutive windows of torch's DDP; *torch A/A*: torch's DDP again on its own copy, the ratio "
             "noise alone gives.", "",
             "| model | accum | torch window (ms) | noise (ms) | " + " | ".join(names[1:]) + " |",
             "|---|---|---|---|" + "---|" * (len(names) - 1)]
    for r in rows:
        lines.append(f"| {r['model']} | {r['accum']} | {r['median_ms']['torch']:.1f} | {r['noise_ms']:.1f} | "
                     + " | ".join(f"{r['paired_ratio'][n]:.3f}" for n in names[1:]) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
