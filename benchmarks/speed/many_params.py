"""A model of many small parameters, where gradsync's per-parameter Python cost shows (issue 29).

    python benchmarks/speed/many_params.py                     # 2 ranks, ~3 min: results/speed-many-params-<N>cpu-<date>
    python benchmarks/speed/many_params.py --quick --out /tmp  # a smoke test, not a measurement
    python benchmarks/compare.py BEFORE.json AFTER.json        # two runs (e.g. two commits) side by side

The model: 200 blocks of ``nn.Linear(64, 64)`` + ``nn.LayerNorm(64)`` and a bias-free head,
801 parameter tensors of 64 to 4096 elements; per window each one passes through gradsync's
post-accumulate-grad hook, its bucket slot and the write-back, where torch's DDP does the same in C++.
Variants, each on an identical copy of the model, take turns window by window in the same process
group (order shuffled every round, a window's time is the maximum over ranks):

- ``torch``: torch's DDP with its defaults (the reference); ``torch-views``: with ``gradient_as_bucket_view``;
- ``gradsync``: gradsync's DDP with gradient views (docs/choosing.md's setting), ``no_sync`` for all
  but the window's last micro-step, as torch's; ``gradsync-copy``: without views;
- ``gradsync-acc``: gradsync's DDP driven by ``GradientAccumulator(steps=accum)`` (mean loss).

Ratios are paired round by round (median of the per-round ratios, with their interquartile range);
noise is the median difference between consecutive windows of ``torch``. Besides the wall time (max
over ranks), each window's CPU time (process time summed over ranks, gloo's threads included) is
paired the same way: on a machine shared with other jobs it moves much less than the wall time.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

import gradsync
from gradsync.tools.bench.measure import alternate
from gradsync.tools.bench.models import Engine, GradsyncEngine, ModelSpec, TorchEngine, TorchViewsEngine, loss_fn
from gradsync.tools.bench.harness import describe, paired, run_paired_benchmark


@dataclass(frozen=True, kw_only=True)
class BlocksSpec(ModelSpec):
    """``depth`` blocks of Linear(width, width) + LayerNorm(width), then a bias-free head to 16 classes."""

    def build(self, seed: int = 0) -> nn.Module:
        torch.set_flush_denormal(True)
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        for _ in range(self.depth):
            layers += [nn.Linear(self.width, self.width), nn.LayerNorm(self.width)]
        return nn.Sequential(*layers, nn.Linear(self.width, 16, bias=False))


MODELS = [BlocksSpec(name="blocks-200x(64+ln)", kind="mlp", width=64, depth=200, batch=8)]
QUICK = [BlocksSpec(name="blocks-4x(16+ln)", kind="mlp", width=16, depth=4, batch=4)]


class NoViewsEngine(GradsyncEngine):
    name = "gradsync-copy"
    view = False


class AccumulatorEngine(GradsyncEngine):
    """gradsync's DDP driven by ``GradientAccumulator``: the window's last micro-step syncs."""

    name = "gradsync-acc"
    accum = 1

    def micro_step(self, x, y, sync, probe=None):
        acc = self.__dict__.get("acc")
        if acc is None or acc.steps != self.accum:
            acc = self.acc = gradsync.GradientAccumulator(self.model, steps=self.accum)
        with acc.accumulate():
            acc.backward(loss_fn(self.model(x), y))
        assert acc.sync_gradients == sync  # the same micro-step syncs as in the other variants


VARIANTS: dict[str, type[Engine]] = {"torch": TorchEngine, "torch-views": TorchViewsEngine,
                                     "gradsync": GradsyncEngine, "gradsync-copy": NoViewsEngine,
                                     "gradsync-acc": AccumulatorEngine}


def time_rank(rank, world, spec, accum, warmup, reps) -> dict:
    kw = dict(bucket_cap_mb=25.0, view=None, set_to_none=True, lr=1e-3)

    base = spec.build(seed=0)
    engines = {name: cls(copy.deepcopy(base), **kw) for name, cls in VARIANTS.items()}
    for engine in engines.values():
        engine.accum = accum
    return alternate(engines, spec, rank, accum, warmup, reps)  # {"times": wall, "cpu": process time}


def summarize(res: dict) -> dict:
    out = paired(res["times"], "torch")
    cpu = paired(res["cpu"], "torch")
    out["cpu_median_ms"], out["cpu_paired_ratio"], out["cpu_ratio_iqr"] = \
        cpu["median_ms"], cpu["paired_ratio"], cpu["ratio_iqr"]
    out["raw_cpu"] = res["cpu"]
    return out


def report(record: dict) -> str:
    names = list(VARIANTS)
    lines = [
        "# Many small parameters: gradsync against torch's DDP (issue 29)",
        "",
        describe(record, ", one intra-op thread per rank") + " Model: 200 blocks of Linear(64, 64) + "
        "LayerNorm(64) and a bias-free head (801 parameter tensors, 0.86 M parameters), batch 8 per rank, AdamW. "
        "Ratio = median over rounds of (variant / torch) in the same round; noise = median |difference| between "
        "consecutive windows of torch.",
        "",
        "| model | accum | " + " | ".join(f"{n} ms" for n in names) + " | "
        + " | ".join(f"{n} / torch" for n in names[1:]) + " | noise ms |",
        "|---|---|" + "---|" * (2 * len(names) - 1) + "---|",
    ]
    for r in record["rows"]:
        lines.append(f"| {r['model']} | {r['accum']} | " + " | ".join(f"{r['median_ms'][n]:.2f}" for n in names)
                     + " | " + " | ".join(f"**{r['paired_ratio'][n]:.3f}**" if n == "gradsync" else
                                          f"{r['paired_ratio'][n]:.3f}" for n in names[1:])
                     + f" | {r['noise_ms']:.2f} |")
    lines += ["", "Interquartile ranges of the per-round ratios, wall time and CPU time (process time summed "
              "over ranks, paired the same way):", "",
              "| model | accum | " + " | ".join(f"{n} / torch wall [IQR]" for n in names[1:]) + " | "
              + " | ".join(f"{n} / torch CPU [IQR]" for n in names[1:]) + " |",
              "|---|---|" + "---|" * (2 * len(names) - 2)]
    for r in record["rows"]:
        wall = [f"{r['paired_ratio'][n]:.3f} [{r['ratio_iqr'][n][0]:.2f}-{r['ratio_iqr'][n][1]:.2f}]" for n in names[1:]]
        cpu = [f"{r['cpu_paired_ratio'][n]:.3f} [{r['cpu_ratio_iqr'][n][0]:.2f}-{r['cpu_ratio_iqr'][n][1]:.2f}]"
               for n in names[1:]]
        lines.append(f"| {r['model']} | {r['accum']} | " + " | ".join(wall + cpu) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    return run_paired_benchmark("speed-many-params", __doc__, MODELS, QUICK, time_rank, summarize, report, argv,
                                reps=31, warmup=5)


if __name__ == "__main__":
    main()
