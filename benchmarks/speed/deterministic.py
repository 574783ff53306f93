"""What ``deterministic=True`` costs per window: the same ranks, windows alternating, against the default reduction.

    python benchmarks/speed/deterministic.py                 # results/speed-deterministic-<N>cpu-<date>.{json,md}
    python benchmarks/speed/deterministic.py --quick --out /tmp   # a smoke test

gradsync's DDP (no gradient views: ``deterministic=True`` refuses them) three times on identical model copies:
``default`` (bucketed all-reduce, micro-steps added into ``.grad``), ``default A/A`` (a second copy: the noise)
and ``deterministic`` (each micro-step's gradient kept in a binary tree, each bucket all-to-all, summed in
rank order, all-gathered). Each round runs one window of each in a shuffled order; a window's time is the
maximum over ranks, ratios are paired round by round. Accumulation 4 keeps four micro-steps apart in the tree.
Bytes on the wire per window are those of a ring all-reduce by construction (``docs/deterministic.md``).
"""
from __future__ import annotations

import gradsync
from gradsync.tools.bench.harness import paired, paired_report, run_paired_benchmark, time_variants, with_aa
from gradsync.tools.bench.models import GradsyncEngine, ModelSpec

MODELS = [ModelSpec(name="mlp-8.4M", kind="mlp", width=1024, depth=8, batch=32),
          ModelSpec(name="gpt-12M", kind="gpt", width=384, depth=6, batch=2, seq=64)]


class Deterministic(GradsyncEngine):
    name = "deterministic"

    def wrap(self, module, bucket_cap_mb, view):
        return gradsync.DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb, deterministic=True)


def time_rank(rank, world, spec, accum, warmup, reps) -> dict:
    kw = dict(bucket_cap_mb=25.0, view=False, set_to_none=True, lr=1e-3)
    variants = with_aa({"default": lambda m: GradsyncEngine(m, **kw),
                        "deterministic": lambda m: Deterministic(m, **kw)}, "default")
    return time_variants(rank, world, spec, variants, accum, warmup, reps)


def summarize(times: dict) -> dict:
    return paired(times, "default")


def report(record: dict) -> str:
    return paired_report("deterministic=True: cost per optimizer window", record, ", no gradient views", "default",
                         "deterministic")


def main(argv: list[str] | None = None) -> dict:
    quick = [ModelSpec(name="mlp-tiny", kind="mlp", width=32, depth=2, batch=4)]
    return run_paired_benchmark("speed-deterministic", __doc__, MODELS, quick, time_rank, summarize, report, argv)


if __name__ == "__main__":
    main()
