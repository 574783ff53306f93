"""Paired A/B in one run (issue 17 item 2): gradsync on gradient views as now (one pass: the divided
copy into the bucket), the previous views path (a copy, then a whole-bucket div_ at launch), gradsync
without views, torch's DDP and torch's DDP with views, on gradsync bench's models, AdamW.

    python benchmarks/speed/views_ab.py [timed windows per engine, default 9] [--quick]

Prints per model and accumulation the paired (per-round) ratio of each engine to torch's DDP and
of the current views path to the previous one, with the load average before and after.
"""
import os
import sys

import torch

from gradsync.engine.store import BucketStore
from gradsync.tools.bench.harness import paired, time_variants
from gradsync.tools.bench.models import GradsyncEngine, ModelSpec, TorchEngine, TorchViewsEngine
from gradsync.tools.launch import run_ranks


class PreviousViews(GradsyncEngine):
    """The views path before issue 17: copy without dividing, then divide the whole bucket at launch."""

    name = "gradsync-prev"

    def wrap(self, module, cap, view):
        model = super().wrap(module, cap, view)
        store, launcher = model.reducer.store, model.reducer.launcher
        store.copy_in_bucket = lambda bucket, divide: BucketStore.copy_in_bucket(store, bucket, False)
        launch = launcher.launch

        def divide_then_launch(bucket, buckets, traced):
            if launcher.hook is None:
                bucket.buffer.div_(store.world_size)
            launch(bucket, buckets, traced)
        launcher.launch = divide_then_launch
        return model


class NoViews(GradsyncEngine):
    name = "gradsync-noview"
    view = False


def rank_fn(rank, world, spec, accum, reps, warmup=2):
    torch.set_num_threads(1)
    kw = dict(bucket_cap_mb=25, view=None, set_to_none=True, lr=1e-3)
    variants = {c.name: (lambda m, c=c: c(m, **kw))
                for c in (GradsyncEngine, PreviousViews, NoViews, TorchEngine, TorchViewsEngine)}
    return time_variants(rank, world, spec, variants, accum, warmup, reps)


def main(reps: int, quick: bool = False) -> list[str]:
    specs = [ModelSpec(name="mlp-8.4M", kind="mlp", width=1024, depth=8, batch=32),
             ModelSpec(name="gpt-12M", kind="gpt", width=384, depth=6, batch=2, seq=64)]
    if quick:  # a smoke test
        specs = [ModelSpec(name="mlp-tiny", kind="mlp", width=64, depth=2, batch=4)]
    lines = []
    for spec in specs:
        for accum in (1, 4):
            load = os.getloadavg()[0]
            t = run_ranks(rank_fn, 2, spec, accum, reps, timeout=900)[0]
            to_torch, to_prev = paired(t, "torch"), paired(t, "gradsync-prev")
            cells = [f"{n} {r:.3f}" for n, r in to_torch["paired_ratio"].items()]
            lines.append(f"{spec.name} accum {accum} load {load:.1f}->{os.getloadavg()[0]:.1f} torch "
                         f"{to_torch['median_ms']['torch']:.0f} ms | " + " | ".join(cells)
                         + f" | new/prev {to_prev['paired_ratio']['gradsync']:.3f}")
            print(lines[-1], flush=True)
    return lines


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--quick"]
    main(int(args[0]) if args else 9, quick="--quick" in sys.argv)
