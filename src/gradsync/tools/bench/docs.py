"""Keep the measured numbers in the docs equal to the newest benchmark results.

Every block between ``<!-- bench:NAME -->`` and ``<!-- bench:end -->`` in ``DOCS`` is generated
from one ``gradsync bench`` record (the newest full run in ``benchmarks/results``)::

    python -m gradsync.tools.bench.docs          # rewrite the blocks
    python -m gradsync.tools.bench.docs --check  # exit 1 if a block is stale (tests/tools/test_docs.py)
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re

from .report import memory_savings, overlap, ratio_table

DOCS = ("README.md", "docs/choosing.md", "benchmarks/README.md")
RESULTS = "benchmarks/results"
BLOCK = re.compile(r"(<!-- bench:(\w+) -->\n)(.*?)(<!-- bench:end -->)", re.S)


def newest_results(results_dir: str = RESULTS) -> str:
    """The JSON of the newest full run (by the date in its name; ``--quick`` runs do not count)."""
    stamped = [(m.group(1), path) for path in glob.glob(os.path.join(results_dir, "bench-*.json"))
               if (m := re.search(r"-(\d{8}-\d{4})\.json$", path))]
    if not stamped:
        raise FileNotFoundError(f"no full `gradsync bench` results (bench-*-YYYYMMDD-HHMM.json) in {results_dir}")
    return max(stamped)[1]


def _range(values, fmt: str = ".2f", unit: str = "") -> str:
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return f"{lo}{unit}" if lo == hi else f"{lo}-{hi}{unit}"


def _ratios(record: dict, engine: str, accum: int) -> str:
    return _range([r["paired_ratio"][engine] for r in record["models"] if r["accum"] == accum], ".3f")


def blocks(record: dict, link: str) -> dict[str, str]:
    """Every block's text; ``link`` is the record's markdown report, relative to the doc."""
    m, models = record["machine"], record["models"]
    accums = sorted({r["accum"] for r in models})
    one, many = accums[0], accums[-1]
    every = " and ".join(map(str, accums))
    reduced, torch_reduced = (_range([r["bytes"][e]["by_op"]["all_reduce:gradients"] / r["grad_bytes"]
                                      for r in models], ".3f") for e in ("gradsync", "torch"))
    control = _range([r["bytes"]["gradsync"]["by_op"].get("all_reduce:control", 0) for r in models],
                     ".0f", " bytes")  # int32 counters
    bf16 = {a: _ratios(record, "gradsync-bf16", a) for a in accums}
    saving = {r["set_to_none"]: r["saving"] for r in memory_savings(record) if r["engine"] == "gradsync"}
    source = (f"[{record['date']}, {record['world']} gloo ranks on {m['cpu']}, {m['cores']} cores]({link}) "
              f"(load average {m['load_before'][0]:.1f} before, {m['load_after'][0]:.1f} after; "
              f"torch {m['torch']}; the whole run took {record['seconds']:.0f} s)")
    out = {"source": f"Measured numbers on this page come from {source}."}
    out["readme"] = "\n".join([
        f"Latest run: {source}, time per optimizer step, median (min-max) ms, and the paired ratio to "
        "torch's C++ DDP:", "",
        ratio_table(record, [e for e in record["engines"] if e not in ("torch", "naive")]), "",
        f"Bytes per optimizer step: {reduced} x the gradient at accumulation {every} (the ring "
        f"all-reduce minimum; bf16 compression: {_bf16_bytes(models)}), plus gradsync's end-of-backward "
        f"check of {control}. "
        f"`gradient_as_bucket_view` saved {saving[True]:.2f} (`zero_grad(set_to_none=True)`) and "
        f"{saving[False]:.2f} (`set_to_none=False`) of one gradient copy of peak memory on "
        f"{record['memory_model']}."])
    out["buckets"] = _buckets(record)
    out["views"] = _views(record)
    out["accumulation"] = (
        f"The latest run counted {reduced} x the gradient bytes all-reduced per optimizer step at "
        f"accumulation {every} (torch's DDP: {torch_reduced}), plus an end-of-backward check of "
        f"{control}. At accumulation {many} gradsync took {_ratios(record, 'gradsync', many)} x torch's "
        f"step (at {one}: {_ratios(record, 'gradsync', one)}), paired ratios.")
    out["compression"] = (
        f"Measured: {_bf16_bytes(models)} x the minimum bytes. bf16 took {bf16[one]} x torch's step at "
        f"accumulation {one} and {bf16[many]} x at accumulation {many} (paired ratios).")
    out["sharded"] = (
        f"In the latest run sharded mode took {_ratios(record, 'gradsync-sharded', one)} x torch's step "
        f"at accumulation {one} and {_ratios(record, 'gradsync-sharded', many)} x at accumulation "
        f"{many} (paired ratios).")
    out["python"] = _python(record)
    out["breakdown"] = _breakdown(record)
    out["latest"] = "\n".join([
        f"Run: {source}.", "",
        f"- Step time, gradsync / torch (paired): {'; '.join(_row_ratios(record, 'gradsync'))}.",
        f"- Bytes all-reduced per window: {reduced} x the gradient (bf16 compression {_bf16_bytes(models)}).",
        f"- Gradient-view saving: {saving[True]:.2f} (`set_to_none=True`) and {saving[False]:.2f} "
        "(`set_to_none=False`) of one gradient copy.",
        f"- Sharded mode / torch (paired): {'; '.join(_row_ratios(record, 'gradsync-sharded'))}.",
        f"- {_python(record)}"])
    return out


def _bf16_bytes(models: list[dict]) -> str:
    return _range([r["bytes"]["gradsync-bf16"]["by_op"]["all_reduce:gradients"] / r["grad_bytes"]
                   for r in models], ".3f")


def _row_ratios(record: dict, engine: str) -> list[str]:
    return [f"{r['model']} at accumulation {r['accum']}: {r['paired_ratio'][engine]:.3f}" for r in record["models"]]


def _buckets(record: dict) -> str:
    row = max(record["models"], key=lambda r: (r["grad_bytes"], -r["accum"]))  # the timeline plot's run
    it = row["trace"][-1]
    t0, end = it["backward_start"], 1e3 * (it["backward_end"] - it["backward_start"])
    starts = ", ".join(f"{b['bytes'] / 1e6:.1f} MB at {1e3 * (b['launch'] - t0):.0f} ms" for b in it["buckets"])
    lines = [f"In the timeline plot ({row['model']}, accumulation {row['accum']}) the buckets launch "
             f"({starts}) within a {end:.0f} ms backward. Share of communication hidden behind backward:", "",
             "| model | accum | buckets | hidden share | exposed ms |", "|---|---|---|---|---|"]
    for r in record["models"]:
        o = overlap(r["trace"])
        lines.append(f"| {r['model']} | {r['accum']} | {o['buckets']} | {o['share']:.2f} | {1e3 * o['exposed_s']:.1f} |")
    lines += ["", f"| `bucket_cap_mb` ({record['buckets'][0]['model']}) | buckets | gradsync ms | torch ms | "
              "gradsync / torch (paired) |", "|---|---|---|---|---|"]
    for r in record["buckets"]:
        t = r["times"]
        lines.append(f"| {r['cap']:g} | {r['buckets']} | {1e3 * t['gradsync']['median']:.0f} | "
                     f"{1e3 * t['torch']['median']:.0f} | {r['paired_ratio']['gradsync']:.3f} |")
    return "\n".join(lines)


def _breakdown(record: dict) -> str:
    """The engines' own passes and the exposed communication, from the profiling pass."""
    engines = [e for e in ("gradsync", "torch-views", "torch") if e in record["engines"]]
    lines = ["Profiling pass of the same run (ms per optimizer step, rank 0; [all phases and engines]"
             f"({record.get('_link', '')})):", "",
             "| model | accum | engine | copy into buckets | division | write-back | exposed + other | "
             "step | paired / torch |", "|---|---|---|---|---|---|---|---|---|"]
    for r in record["models"]:
        for e in engines:
            b = r["breakdown"]["engines"][e]
            lines.append(f"| {r['model']} | {r['accum']} | {e} | {1e3 * b['bucket copy-in']:.1f} | "
                         f"{1e3 * b['division']:.1f} | {1e3 * b['write-back']:.1f} | "
                         f"{1e3 * b['communication exposed + other']:.1f} | {1e3 * b['total']:.0f} | "
                         f"{r['paired_ratio'][e]:.3f} |")
    return "\n".join(lines)


def _views(record: dict) -> str:
    mem = record["memory"]
    peak = {(r["engine"], r["view"], r["set_to_none"]): r["peak_bytes"] / 2**20 for r in mem}
    saving = {(r["engine"], r["set_to_none"]): r["saving"] for r in memory_savings(record)}
    lines = [f"Measured on {record['memory_model']} (one gradient copy = {mem[0]['grad_bytes'] / 2**20:.0f} MiB), "
             "steady-state peak RSS:", "",
             "| zero_grad | without views | with views | saving (gradient copies) | torch's DDP, saving |",
             "|---|---|---|---|---|"]
    for stn, label in ((True, "`set_to_none=True` (torch's default)"), (False, "`set_to_none=False`")):
        lines.append(f"| {label} | {peak[('gradsync', False, stn)]:.0f} MiB | {peak[('gradsync', True, stn)]:.0f} MiB | "
                     f"**{saving[('gradsync', stn)]:.2f}** | {saving[('torch', stn)]:.2f} |")
    return "\n".join(lines)


def _python(record: dict) -> str:
    shares = [r["profile"]["gradsync_self_s"] / r["profile"]["total_s"] for r in record["models"]]
    o = record["overhead"]
    fast, n = o["min_s"], o["params"]
    per = {e: 1e6 * (fast[f"{e} synced"] - fast["plain module"]) / n for e in ("gradsync", "torch")}
    return (f"Profiled (cProfile), gradsync's own Python functions took {_range([100 * s for s in shares], '.1f', '%')} "
            f"of a step. Per parameter, a synced backward cost {per['gradsync']:.1f} us of bookkeeping "
            f"against {per['torch']:.1f} us for torch's C++ reducer ({n} tiny parameters, fastest runs).")


def render(text: str, record: dict, link: str) -> str:
    """``text`` with every bench block regenerated from ``record``."""
    made = blocks({**record, "_link": link}, link)

    def fill(m: re.Match) -> str:
        if m.group(2) not in made:
            raise KeyError(f"unknown block <!-- bench:{m.group(2)} -->; known: {', '.join(sorted(made))}")
        return m.group(1) + made[m.group(2)] + "\n" + m.group(4)
    return BLOCK.sub(fill, text)


def stale(root: str = ".", results: str | None = None, write: bool = False) -> list[str]:
    """The docs under ``root`` whose blocks differ from the results (rewritten when ``write``)."""
    results = results or newest_results(os.path.join(root, RESULTS))
    with open(results) as f:
        record = json.load(f)
    report = os.path.splitext(results)[0] + ".md"
    out = []
    for doc in DOCS:
        path = os.path.join(root, doc)
        with open(path) as f:
            text = f.read()
        new = render(text, record, os.path.relpath(report, os.path.dirname(path)))
        if new != text:
            out.append(doc)
            if write:
                with open(path, "w") as f:
                    f.write(new)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m gradsync.tools.bench.docs", description=__doc__.splitlines()[0])
    p.add_argument("--results", help="a bench JSON (default: the newest full run in benchmarks/results)")
    p.add_argument("--root", default=".", help="the repository root (default: here)")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a doc is stale")
    args = p.parse_args(argv)
    changed = stale(args.root, args.results, write=not args.check)
    verb = "stale" if args.check else "rewritten"
    print(f"{verb}: {', '.join(changed)}" if changed else "docs match the results")
    if args.check and changed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
