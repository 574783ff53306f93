"""Peak RSS per rank of ShardedDataParallel at 4 MB buckets: max_inflight 1 or 2, staging pool on or off, and FSDP2.

    python benchmarks/sharded/knobs.py   # prints a table; results/sharded-knobs-*.md holds one run
"""
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


def main() -> None:
    variants = {f"max_inflight={i}, pool {'on' if p else 'off'}": engine(i, p) for i in (1, 2) for p in (True, False)}
    variants["FSDP2 (reshard_after_forward=False)"] = S.FSDP2
    print("| variant | " + " | ".join(spec.name for spec in S.MODELS) + " |")
    print("|---|" + "---|" * len(S.MODELS))
    for label, cls in variants.items():
        peaks = [max(m["peak_mib"] for m in run_ranks(S.memory_rank, 2, spec, cls, 2, 3, timeout=600))
                 for spec in S.MODELS]
        print(f"| {label} | " + " | ".join(f"{p:.0f}" for p in peaks) + " |", flush=True)


if __name__ == "__main__":
    main()
