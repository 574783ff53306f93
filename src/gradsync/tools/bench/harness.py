"""The harness every script under ``benchmarks/`` uses: paired timing, load, records.

One rule runs through it: variants of one question run in the same ranks, on deep copies of one
model, taking turns window by window in an order shuffled every round (``round_order``), so load
drifting during a run hits every variant alike. A variant's ratio to a reference is the median of
the per-round ratios (``paired``), and an A/A pair (the reference against a second copy of itself)
says how large a ratio the noise alone makes.

    from gradsync.tools.bench import harness
    record = harness.run_paired_benchmark("speed-header-cost", __doc__, MODELS, QUICK, time_rank,
                                          summarize, report)

Records are written by ``write_record`` as ``<question>-<scenario>-<N>cpu-<date>.{json,md}`` under
``benchmarks/results/`` (``record_stem``); ``gradsync.tools.bench.compare`` diffs two of them.
The emulated network link lives in ``gradsync.tools.bench.netns``.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .measure import mmap_large_allocations, reduce_values, reset_peak_rss, round_order, run_window, status_kib
from .models import Engine, ModelSpec

__all__ = ["RESULTS", "round_order", "run_window", "reduce_values", "reduce_max", "time_variants", "with_aa", "paired", "paired_cells", "paired_report",
           "quartiles", "spread", "describe", "machine_info", "LoadWatch", "record_stem", "write_record",
           "timing_parser", "run_paired_benchmark", "status_kib", "reset_peak_rss", "mmap_large_allocations"]

RESULTS = Path(__file__).resolve().parents[4] / "benchmarks" / "results"  # in a source checkout


# ---------------------------------------------------------------- timing (inside the ranks)
def reduce_max(values: list[float]) -> list[float]:
    """Each value's maximum over ranks (a window ends when its slowest rank does)."""
    import torch.distributed as dist
    return reduce_values(values, dist.ReduceOp.MAX)


def time_variants(rank: int, world: int, spec: ModelSpec, variants: dict[str, Callable[[torch.nn.Module], Engine]],
                  accum: int, warmup: int, reps: int) -> dict[str, list[float]]:
    """Each variant's window times (seconds, max over ranks) after ``warmup`` windows, variants alternating.

    ``variants`` maps a name to a function that wraps a deep copy of ``spec``'s model in an ``Engine``;
    a window is ``accum`` micro-steps (synced on the last) and the optimizer step (``run_window``).
    """
    import torch.distributed as dist
    base = spec.build(seed=0)
    engines = {name: make(copy.deepcopy(base)) for name, make in variants.items()}
    names = list(engines)
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(warmup + reps):
        for name in round_order(names, rep):
            dist.barrier()
            start = time.perf_counter()
            run_window(engines[name], spec, rank, rep, accum)
            wall = reduce_max([time.perf_counter() - start])[0]
            if rep >= warmup:
                times[name].append(wall)
    return times


def with_aa(variants: dict[str, Callable], reference: str) -> dict[str, Callable]:
    """``variants`` plus ``"<reference> A/A"``: the reference again, on its own model copy.

    Its paired ratio to the reference is what noise alone gives (``compare`` reads it as the band).
    """
    return {**variants, f"{reference} A/A": variants[reference]}


# ---------------------------------------------------------------- statistics
def quartiles(xs: list[float]) -> list[float]:
    """The lower and upper quartile of ``xs`` (both the value itself for one sample)."""
    s = sorted(xs)
    return [s[len(s) // 4], s[(3 * len(s)) // 4]] if len(s) > 1 else [s[0], s[0]]


def spread(samples: list[float]) -> dict:
    """Median, min, max and quartiles of a list of times, in the samples' unit."""
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples),
            "iqr": quartiles(samples), "n": len(samples)}


def paired(times: dict[str, list[float]], base: str) -> dict:
    """Medians (ms), ratios and differences to ``base`` paired round by round, and the noise of ``base``.

    ``noise_ms`` is the median |difference| between consecutive windows of ``base``; ``ratio_iqr``
    the interquartile range of each variant's per-round ratios.
    """
    ref = times[base]
    per_round = {n: [a / b for a, b in zip(t, ref)] for n, t in times.items()}
    return {"median_ms": {n: 1e3 * statistics.median(t) for n, t in times.items()},
            "paired_ratio": {n: statistics.median(r) for n, r in per_round.items()},
            "paired_diff_ms": {n: 1e3 * statistics.median(a - b for a, b in zip(t, ref)) for n, t in times.items()},
            "ratio_iqr": {n: quartiles(r) for n, r in per_round.items()},
            "noise_ms": 1e3 * statistics.median(abs(a - b) for a, b in zip(ref, ref[1:] + ref[:1])),
            "raw": times}


def paired_cells(row: dict, name: str, aa: str) -> str:
    """A ``paired`` row's markdown cells: ``name``'s ratio [IQR] | its paired cost ms | ``aa``'s ratio [IQR] | noise ms."""
    q, iqr = row["paired_ratio"], row["ratio_iqr"]
    return (f"{q[name]:.3f} [{iqr[name][0]:.3f}-{iqr[name][1]:.3f}] | {row['paired_diff_ms'][name]:+.2f} | "
            f"{q[aa]:.3f} [{iqr[aa][0]:.3f}-{iqr[aa][1]:.3f}] | {row['noise_ms']:.2f}")


def paired_report(title: str, record: dict, setup: str, reference: str, variant: str, extra_headers: Sequence[str] = (),
                  extra_cells: Callable[[dict], Sequence[str]] | None = None) -> str:
    """A paired record's markdown: ``title``, ``describe`` (with ``setup``), what the columns mean, and one row per
    model and accumulation: both medians, ``paired_cells`` and any ``extra_cells(row)`` under ``extra_headers``."""
    head = ["model", "accum", f"{reference} ms", f"{variant} ms", f"{variant} / {reference} [IQR]", "cost ms",
            "A/A [IQR]", "noise ms", *extra_headers]
    lines = [f"# {title}", "", describe(record, setup) + f" Ratio = median over rounds of (variant / {reference}) in "
             f"the same round; cost = the paired median difference; A/A = {reference} against a second copy of itself "
             "(the noise).", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in record["rows"]:
        m = r["median_ms"]
        cells = [r["model"], str(r["accum"]), f"{m[reference]:.1f}", f"{m[variant]:.1f}",
                 paired_cells(r, variant, f"{reference} A/A"), *(extra_cells(r) if extra_cells else ())]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the machine
def machine_info() -> dict:
    """CPU model, cores, a file-name slug (``<cpu>-<N>cpu``), torch and Python versions, the load now."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    cores = os.cpu_count() or 1
    slug = re.sub(r"[^a-z0-9]+", "-", cpu.lower().replace("(r)", "").replace("(tm)", "")).strip("-")
    return {"cpu": cpu, "cores": cores, "slug": f"{slug[:32].strip('-')}-{cores}cpu",
            "torch": torch.__version__, "python": platform.python_version(),
            "load_before": os.getloadavg()}


class LoadWatch:
    """The machine's load average (1, 5, 15 min) before and after a run, and its wall time::

        with LoadWatch() as load:
            ...
        record.update(load.as_record())   # load_before, load_after, seconds
    """

    def __init__(self):
        self.before, self.after, self.start, self.seconds = os.getloadavg(), None, time.time(), None

    def __enter__(self) -> LoadWatch:
        self.before, self.start = os.getloadavg(), time.time()
        return self

    def __exit__(self, *exc) -> None:
        self.after, self.seconds = os.getloadavg(), time.time() - self.start

    def as_record(self) -> dict:
        after = self.after if self.after is not None else os.getloadavg()
        seconds = self.seconds if self.seconds is not None else time.time() - self.start
        return {"load_before": list(self.before), "load_after": list(after), "seconds": seconds}


def describe(record: dict, setup: str = "") -> str:
    """The sentence a paired report starts with: machine, torch, repetitions, order, load."""
    m = record["machine"]
    return (f"{record['world']} gloo ranks on {m['cpu']} ({m['cores']} cores), torch {record['torch']}{setup}, "
            f"{record['reps']} timed windows per variant after {record['warmup']} warm-up, variants "
            f"alternating; load average {record['load_before'][0]:.1f} before, {record['load_after'][0]:.1f} after.")


# ---------------------------------------------------------------- records
def record_stem(scenario: str, quick: bool = False, date: datetime.date | None = None) -> str:
    """``<scenario>-<N>cpu-<YYYY-MM-DD>`` (``-quick`` for smoke runs): what, where and when, in the name.

    ``scenario`` starts with the question's folder, e.g. ``speed-loopback``, ``sharded-prefetch``.
    """
    date = date or datetime.date.today()
    return f"{scenario}-{os.cpu_count() or 1}cpu-{date.isoformat()}" + ("-quick" if quick else "")


def write_record(out: Path | str, stem: str, record: dict, markdown: str | None = None) -> Path:
    """Write ``out/stem.json`` (and ``out/stem.md`` when given); return the path of the markdown (or JSON)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    path = out / f"{stem}.json"
    if markdown is not None:
        path = out / f"{stem}.md"
        path.write_text(markdown)
    print(f"wrote {path}", flush=True)
    return path


def timing_parser(doc: str, reps: int = 21, warmup: int = 3, accum: tuple[int, ...] = (1, 4)) -> argparse.ArgumentParser:
    """The options every paired script takes: --world --reps --warmup --accum --out --name --quick."""
    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--reps", type=int, default=reps)
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--accum", type=int, nargs="+", default=list(accum))
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--name", help="file name stem (default: <question>-<scenario>-<N>cpu-<date>)")
    p.add_argument("--quick", action="store_true", help="tiny models, 1 window: a smoke test, not a measurement")
    return p


def run_paired_benchmark(scenario: str, doc: str, models: list[ModelSpec], quick_models: list[ModelSpec],
                         time_rank: Callable, summarize: Callable[[dict], dict], report: Callable[[dict], str],
                         argv: list[str] | None = None, reps: int = 21, warmup: int = 3,
                         quick_warmup: int = 1) -> dict:
    """A paired script's whole command line: time ``models`` x ``--accum`` in ``--world`` forked ranks.

    ``time_rank(rank, world, spec, accum, warmup, reps)`` runs in each rank and returns what
    ``summarize`` turns into a row (with a ``paired_ratio``); ``report(record)`` is the markdown.
    Writes ``record_stem(scenario)`` .json and .md under ``--out`` and returns the record.
    """
    from ..launch import run_ranks
    args = timing_parser(doc, reps, warmup).parse_args(argv)
    if args.quick:
        args.reps, args.warmup, models = 1, quick_warmup, quick_models
    rows = []
    with LoadWatch() as load:
        for spec in models:
            for accum in args.accum:
                times = run_ranks(time_rank, args.world, spec, accum, args.warmup, args.reps, timeout=1800)[0]
                rows.append({"model": spec.name, "accum": accum, **summarize(times)})
                print(f"{spec.name} accum {accum}: " + ", ".join(
                    f"{n} {r:.3f}" for n, r in rows[-1]["paired_ratio"].items()), flush=True)
    record = {"scenario": scenario, "machine": machine_info(), "world": args.world, "reps": args.reps,
              "warmup": args.warmup, "torch": torch.__version__, "quick": args.quick, **load.as_record(),
              "rows": rows}
    write_record(args.out, args.name or record_stem(scenario, args.quick), record, report(record))
    return record
