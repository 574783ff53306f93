"""What ``check_replicas=True`` costs per step: the same ranks, windows alternating, against it off.

    python benchmarks/speed/replicas_cost.py              # results/speed-replicas-cost-<N>cpu-<date>.{json,md}
    python benchmarks/speed/replicas_cost.py --quick --out /tmp   # a smoke test

gradsync's DDP with gradient views (docs/choosing.md's setting) three times on identical model copies:
``off``, ``off A/A`` (a second copy: the noise) and ``check_replicas`` (each synced backward fingerprints
every bucket's parameters and reduced gradient, 16 bytes per bucket per rank in the control). Each round
runs one window of each in a shuffled order; a window's time is the maximum over ranks, ratios are paired
round by round. The window ratios cannot resolve a few milliseconds on a shared 2-core machine, so
each rank also times the two fingerprint passes alone, on the checked model's own buckets after the
timed windows: ``parameters`` (as a control launches) and ``gradient`` (each reduced bucket as it arrives);
and ``gradsync.audit`` on that model (one micro-batch of the window's size, every rank's gradient of it
compared), whose price is paid only where a run calls it.
"""
from __future__ import annotations

import statistics
import time

import gradsync
from gradsync.tools.bench.harness import paired, paired_report, run_paired_benchmark, time_variants, with_aa
from gradsync.tools.bench.models import GradsyncEngine, ModelSpec, loss_fn

MODELS = [ModelSpec(name="mlp-8.4M", kind="mlp", width=1024, depth=8, batch=32),
          ModelSpec(name="gpt-12M", kind="gpt", width=384, depth=6, batch=2, seq=64),
          ModelSpec(name="mlp-tiny (latency-bound)", kind="mlp", width=64, depth=4, batch=4)]


class Checked(GradsyncEngine):
    name = "check_replicas"

    def wrap(self, module, bucket_cap_mb, view):
        return gradsync.DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=view,
                                                check_replicas=True)


def time_rank(rank, world, spec, accum, warmup, reps) -> dict:
    kw = dict(bucket_cap_mb=25.0, view=True, set_to_none=True, lr=1e-3)
    engines = []
    variants = with_aa({"off": lambda m: GradsyncEngine(m, **kw),
                        "check_replicas": lambda m: engines.append(Checked(m, **kw)) or engines[-1]}, "off")
    times = time_variants(rank, world, spec, variants, accum, warmup, reps)
    reducer = engines[0].model.reducer
    check, buckets = reducer.plane.replicas, reducer.buckets
    passes = {"parameters": lambda: check.outgoing(reducer.plane.device),
              "gradient": lambda: [check.arrived(b.index, b.buffer) for b in buckets]}
    batch = spec.batch_for(rank, 0)
    audit = lambda: gradsync.audit(engines[0].model, lambda module, b: loss_fn(module(b[0]), b[1]), batch)  # noqa: E731
    return {**times, "passes_ms": {name: _median_ms(f) for name, f in passes.items()}, "audit_ms": _median_ms(audit, 10)}


def _median_ms(f, n: int = 30) -> float:
    took = []
    for _ in range(n):
        start = time.perf_counter()
        f()
        took.append(time.perf_counter() - start)
    return 1e3 * statistics.median(took)


def summarize(times: dict) -> dict:
    passes, audit = times.pop("passes_ms"), times.pop("audit_ms")
    return {"passes_ms": passes, "audit_ms": audit, **paired(times, "off")}


def report(record: dict) -> str:
    def passes(r: dict) -> list[str]:
        took = r["passes_ms"]
        return [f"{took['parameters']:.2f} + {took['gradient']:.2f}", f"{sum(took.values()) / r['median_ms']['off']:.3f}",
                f"{r['audit_ms']:.2f}", f"{r['audit_ms'] / r['median_ms']['off']:.3f}"]
    return paired_report("check_replicas=True: cost per optimizer window", record, ", gradient views on", "off",
                         "check_replicas", ["passes alone: parameters + gradient ms", "passes / off", "one audit ms",
                                            "audit / off"], passes)


def main(argv: list[str] | None = None) -> dict:
    quick = [ModelSpec(name="mlp-tiny", kind="mlp", width=32, depth=2, batch=4)]
    return run_paired_benchmark("speed-replicas-cost", __doc__, MODELS, quick, time_rank, summarize, report, argv)


if __name__ == "__main__":
    main()
