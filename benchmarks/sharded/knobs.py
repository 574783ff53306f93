"""Peak RSS per rank of ShardedDataParallel at 4 MB buckets: max_inflight 1 or 2, staging pool on or off, and FSDP2.

    python benchmarks/sharded/knobs.py           # prints a table; results/sharded-knobs-*.md holds one run
    python benchmarks/sharded/knobs.py --quick   # a tiny model: a smoke test
"""
import argparse

import torch

import gradsync
from gradsync.tools.bench import sharding as S
from gradsync.tools.launch import run_ranks


def engine(inflight: int, pool: bool) -> type:
    class Knobs(S.Engine):
        def build(self, module):
            model = gradsync.ShardedDataParallel(module, bucket_cap_mb=4, first_bucket_cap_mb=1, max_inflight=inflight)
            if not pool:
                model.reducer.store.pool.give = lambda *tensors: None
            return model, gradsync.ShardedOptimizer(model, torch.optim.AdamW, lr=S.LR)
    return Knobs


def main(argv: list[str] | None = None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a tiny model, 1 step: a smoke test, not a measurement")
    quick = p.parse_args(argv).quick
    models, (warmup, steps) = (S.QUICK, (1, 1)) if quick else (S.MODELS, (2, 3))
    variants = {f"max_inflight={i}, pool {'on' if p else 'off'}": engine(i, p) for i in (1, 2) for p in (True, False)}
    variants["FSDP2 (reshard_after_forward=False)"] = S.FSDP2
    lines = ["| variant | " + " | ".join(spec.name for spec in models) + " |", "|---|" + "---|" * len(models)]
    print("\n".join(lines))
    for label, cls in variants.items():
        peaks = [max(m["peak_mib"] for m in run_ranks(S.memory_rank, 2, spec, cls, warmup, steps, timeout=600))
                 for spec in models]
        lines.append(f"| {label} | " + " | ".join(f"{p:.0f}" for p in peaks) + " |")
        print(lines[-1], flush=True)
    return lines


if __name__ == "__main__":
    main()
