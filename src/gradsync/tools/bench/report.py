"""Turn a ``gradsync bench`` record into a markdown report (the PNG plots are drawn by ``plots``)."""
from __future__ import annotations

import os

from .breakdown import PHASES
from .plots import MiB, draw

TARGET_RATIO = 1.05
TARGET_SAVING = 0.9


def _ms(x: float) -> str:
    return f"{1e3 * x:.1f}"


def ratio_table(record: dict, engines: list[str] | None = None) -> str:
    """The step-time table: median (min-max) ms per engine and the paired ratio to torch's DDP."""
    engines = engines or [e for e in record["engines"] if e != "torch"]
    head = "| model | accum | torch ms | " + " | ".join(f"{e} ms | {e} / torch" for e in engines) + " |"
    lines = [head, "|" + "---|" * (3 + 2 * len(engines))]
    for row in record["models"]:
        t = row["times"]
        cells = [row["model"], str(row["accum"]), _span(t["torch"])]
        for e in engines:
            cells += [_span(t[e]), f"**{row['paired_ratio'][e]:.3f}**"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratio_details(record: dict) -> list[str]:
    engines = [e for e in record["engines"] if e != "torch"]
    md = ["Ratios to torch three ways: *paired* = median over windows of (engine / torch in the same "
          "round), *medians* = median / median, *min* = fastest / fastest (the least disturbed by other "
          "load); *CPU* = CPU seconds per window of both ranks' processes (gloo threads included), "
          "median / median.", "",
          "| model | accum | engine | paired | medians | min | CPU ms | CPU / torch |", "|---|---|---|---|---|---|---|---|"]
    for row in record["models"]:
        t, c = row["times"], row["cpu"]
        for e in ["torch"] + engines:
            md.append(f"| {row['model']} | {row['accum']} | {e} | {row['paired_ratio'][e]:.3f} | "
                      f"{t[e]['median'] / t['torch']['median']:.3f} | {t[e]['min'] / t['torch']['min']:.3f} | "
                      f"{_ms(c[e]['median'])} | {c[e]['median'] / c['torch']['median']:.3f} |")
    return md + [""]


def _overhead_section(record: dict) -> list[str]:
    o = record.get("overhead")
    if not o:
        return []
    med, fast, n = o["median_s"], o["min_s"], o["params"]
    md = [f"## Per-parameter overhead ({n} tiny parameters, forward + backward, ms)", "",
          "A chain of small linear layers: compute and bytes are negligible, so the difference to the "
          "plain module is each engine's per-parameter bookkeeping (hooks, copies, launches); *synced* "
          "also pays the all-reduce round trips. Variants alternate; median and fastest of the rounds.", "",
          "| variant | median ms | fastest ms | above plain module (fastest), us per parameter |",
          "|---|---|---|---|"]
    for name in med:
        extra = "" if name == "plain module" else f"{1e6 * (fast[name] - fast['plain module']) / n:.1f}"
        md.append(f"| {name} | {_ms(med[name])} | {_ms(fast[name])} | {extra} |")
    return md + [""]


def _span(s: dict) -> str:
    return f"{_ms(s['median'])} ({_ms(s['min'])}-{_ms(s['max'])})"


def overlap(trace: list[dict]) -> dict | None:
    """Share of bucket communication time that ran before the last gradient was produced."""
    shares, exposed, comm = [], [], []
    for it in trace:
        buckets = [b for b in it["buckets"] if {"ready", "launch", "done"} <= b.keys()]
        if not buckets or len(buckets) != len(it["buckets"]):
            continue
        compute_end = max(b["ready"] for b in buckets)
        merged: list[list[float]] = []
        for s, e in sorted((b["launch"], b["done"]) for b in buckets):
            if merged and s <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], e)
            else:
                merged.append([s, e])
        total = sum(e - s for s, e in merged)
        hidden = sum(max(0.0, min(e, compute_end) - s) for s, e in merged)
        comm.append(total)
        shares.append(hidden / total if total > 0 else 0.0)
        exposed.append(max(0.0, max(b["done"] for b in buckets) - compute_end))
    if not shares:
        return None
    n = len(shares)
    return {"share": sum(shares) / n, "comm_s": sum(comm) / n, "exposed_s": sum(exposed) / n,
            "buckets": len(trace[-1]["buckets"]), "iterations": n}


def _targets(record: dict) -> list[str]:
    out = []
    for row in record["models"]:
        r = row["paired_ratio"]["gradsync"]
        r_min = row["times"]["gradsync"]["min"] / row["times"]["torch"]["min"]
        ok = "met" if r <= TARGET_RATIO else "NOT met"
        out.append(f"- step time {row['model']} accumulation {row['accum']}: gradsync/torch = {r:.3f} paired "
                   f"({r_min:.3f} fastest/fastest) (target <= {TARGET_RATIO}): {ok}")
        b = row["bytes"]["gradsync"]["by_op"].get("all_reduce:gradients", 0.0)
        ok = "met" if abs(b - row["grad_bytes"]) < 1 else "NOT met"
        out.append(f"- gradient bytes all-reduced per window, {row['model']} accumulation {row['accum']}: "
                   f"{b / row['grad_bytes']:.3f} x the gradient (target exactly 1): {ok}")
    for m in memory_savings(record):
        if m["engine"] == "gradsync":
            ok = "met" if m["saving"] >= TARGET_SAVING else "NOT met"
            out.append(f"- gradient-view saving, set_to_none={m['set_to_none']}: {m['saving']:.2f} of one "
                       f"gradient copy (target >= {TARGET_SAVING}): {ok}")
    return out


def memory_savings(record: dict) -> list[dict]:
    """The rows with gradient views, each with its saving in gradient copies against the row without."""
    rows = record.get("memory", [])
    base = {(r["engine"], r["set_to_none"]): r["peak_bytes"] for r in rows if not r["view"]}
    out = []
    for r in rows:
        if r["view"]:
            saved = base[(r["engine"], r["set_to_none"])] - r["peak_bytes"]
            out.append({**r, "saving": saved / r["grad_bytes"]})
    return out


def write(record: dict, out_dir: str, stem: str) -> str:
    """Write ``<stem>.md`` (and PNG plots when matplotlib is installed); return the markdown path."""
    plots = draw(record, out_dir, stem)
    m, w = record["machine"], record["world"]
    md = [f"# gradsync bench, {record['date']}", "",
          f"{w} gloo ranks (1 thread each) on {m['cpu']}, {m['cores']} cores; torch {m['torch']}, "
          f"Python {m['python']}. Load average before/after: {m['load_before'][0]:.2f} / "
          f"{m['load_after'][0]:.2f} (after includes this run's own ranks; the CPU may be shared with "
          f"other work: compare ratios, not absolute times). Engines alternate window by window"
          + (" (in a new shuffled order each round)" if record.get("order") == "shuffled" else "") +
          " on identical model copies, data and "
          f"bucket caps ({record['bucket_cap_mb']:g} MB, first bucket 1 MB); {record.get('optimizer', 'SGD')}; "
          f"{record['warmup']} "
          f"warm-up + {record['reps']} timed windows each"
          + ("; denormal floats flushed to zero" if record.get("flush_denormal") else "") +
          "; a window is `accum` micro-steps "
          "(`no_sync` on all but the last) plus the optimizer step; time = max over ranks. "
          f"Total run: {record['seconds']:.0f} s.", ""]
    if record["models"]:
        md += ["## Step time per optimizer step (median, min-max, ms)", "", ratio_table(record), ""]
        md += _ratio_details(record)
        md += ["## Targets", "", *_targets(record), ""]
        md += _breakdown_section(record)
        md += _comm_section(record)
        md += _profile_section(record)
    md += _overhead_section(record)
    if record.get("buckets"):
        md += [f"## Bucket size ({record['buckets'][0]['model']}, accumulation 1, median ms)", "",
               "| bucket_cap_mb | gradsync buckets | gradsync | torch | gradsync / torch (paired) |",
               "|---|---|---|---|---|"]
        for row in record["buckets"]:
            t = row["times"]
            md.append(f"| {row['cap']:g} | {row['buckets']} | {_span(t['gradsync'])} | {_span(t['torch'])} | "
                      f"{row['paired_ratio']['gradsync']:.3f} |")
        md.append("")
    if record["sweep"]:
        swept = list(record["sweep"][0]["times"])
        md += ["## Model-size sweep (MLP, accumulation 1, median ms)", "",
               "| model | params | " + " | ".join(swept) + " | gradsync / torch (paired) |",
               "|" + "---|" * (3 + len(swept))]
        for row in record["sweep"]:
            t = row["times"]
            md.append(f"| {row['model']} | {row['params']:,} | " + " | ".join(_span(t[e]) for e in swept)
                      + f" | {row['paired_ratio']['gradsync']:.3f} |")
        md.append("")
    if record["memory"]:
        md += _memory_section(record)
    md += [f"![{name}]({os.path.basename(path)})" for name, path in plots.items()]
    if not plots:
        md.append("(plots skipped: install matplotlib, e.g. `pip install gradsync[dev]`)")
    path = os.path.join(out_dir, stem + ".md")
    with open(path, "w") as f:
        f.write("\n".join(md) + "\n")
    return path


def _comm_section(record: dict) -> list[str]:
    w = record["world"]
    md = ["## Communication per optimizer step (per rank)", "",
          "Counted at the call: every tensor gradsync and the naive baseline pass to `torch.distributed` "
          "collectives, and every bucket torch's DDP hands to a (counting) comm hook. *Wire* converts "
          f"payload to the bytes one rank sends under ring algorithms (all-reduce 2(W-1)/W = {2 * (w - 1) / w:g}, "
          "reduce-scatter and all-gather (W-1)/W each); the minimum is 2(W-1)/W times the gradient bytes. "
          "Control bytes are gradsync's end-of-backward check (int32 counters).", "",
          "| model | accum | engine | collective calls | gradient payload MiB | parameter payload MiB | control bytes | wire MiB | minimum MiB | wire / minimum |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for row in record["models"]:
        minimum = 2 * (w - 1) / w * row["grad_bytes"]
        for e, b in row["bytes"].items():
            grads = sum(v for k, v in b["by_op"].items() if k.endswith("gradients"))
            control = sum(v for k, v in b["by_op"].items() if k.endswith("control"))
            params = sum(v for k, v in b["by_op"].items() if k.endswith("parameters"))
            md.append(f"| {row['model']} | {row['accum']} | {e} | {b['calls']:g} | {grads / MiB:.2f} | "
                      f"{params / MiB:.2f} | {control:.0f} | {b['ring_wire_bytes'] / MiB:.2f} | {minimum / MiB:.2f} | "
                      f"{b['ring_wire_bytes'] / minimum:.4f} |")
    md += ["", "## Overlap of communication with backward (gradsync comm trace)", "",
           "Share of the buckets' communication time (union of launch..done intervals) that ran before the "
           "last bucket became ready (the end of gradient computation); *exposed* is the wait after it.", "",
           "| model | accum | buckets | comm ms | hidden share | exposed ms |", "|---|---|---|---|---|---|"]
    for row in record["models"]:
        o = overlap(row.get("trace", []))
        if o:
            md.append(f"| {row['model']} | {row['accum']} | {o['buckets']} | {_ms(o['comm_s'])} | "
                      f"{o['share']:.2f} | {_ms(o['exposed_s'])} |")
    return md + [""]


def _profile_section(record: dict) -> list[str]:
    md = ["## Where gradsync's Python time goes (cProfile, rank 0, per optimizer step)", "",
          "cProfile slows Python code (not torch kernels), so these shares are upper bounds.", ""]
    for row in record["models"]:
        p = row.get("profile")
        if not p:
            continue
        hook = p["hook"] or {}
        md += [f"**{row['model']}, accumulation {row['accum']}**: {p['params']} parameters; profiled step "
               f"{_ms(p['total_s'])} ms, of which {_ms(p['gradsync_self_s'])} ms "
               f"({p['gradsync_self_s'] / p['total_s']:.1%}) in gradsync's own functions; the "
               f"post-accumulate-grad hook runs {hook.get('calls', 0):g} times per step at "
               f"{hook.get('us_per_call', 0):.1f} us per call (including the bucket copy and launch).", "",
               "| tottime ms | cumtime ms | calls | function |", "|---|---|---|---|"]
        md += [f"| {r['tottime_ms']:.2f} | {r['cumtime_ms']:.2f} | {r['calls']:g} | `{r['function']}` |"
               for r in p["top"]]
        md.append("")
    return md


def _memory_section(record: dict) -> list[str]:
    rows = record["memory"]
    savings = {(r["engine"], r["set_to_none"]): r["saving"] for r in memory_savings(record)}
    grad = rows[0]["grad_bytes"]
    md = [f"## Steady-state peak memory ({record.get('memory_model', '')}, one gradient copy = "
          f"{grad / MiB:.0f} MiB)", "",
          "Peak resident set (VmHWM, reset after 2 warm-up steps) over the measured steps, above the "
          "process's RSS before the model was built, max over ranks; glibc is told to mmap allocations "
          ">= 256 KiB so freed tensors leave the RSS. Saving = (peak without views - peak with views) "
          "/ one gradient copy. The whole-run peak also covers construction and the warm-up steps "
          "(what /usr/bin/time or a memory limit sees).", "",
          "| engine | gradient_as_bucket_view | zero_grad(set_to_none) | peak MiB | whole-run peak MiB "
          "| saving (gradient copies) |",
          "|---|---|---|---|---|---|"]
    for r in rows:
        s = savings.get((r["engine"], r["set_to_none"])) if r["view"] else None
        whole = r.get("whole_run_peak_bytes")  # absent in records older than this column
        md.append(f"| {r['engine']} | {r['view']} | {r['set_to_none']} | {r['peak_bytes'] / MiB:.0f} | "
                  f"{'' if whole is None else f'{whole / MiB:.0f}'} | {'' if s is None else f'{s:.2f}'} |")
    return md + [""]


def _breakdown_section(record: dict) -> list[str]:
    rows = [r for r in record["models"] if r.get("breakdown")]
    if not rows:
        return []
    md = ["## Where a window's time goes (profiling pass, rank 0, ms per optimizer step)", "",
          "A separate pass after the timed windows (see `src/gradsync/tools/bench/breakdown.py`): timers "
          "around forward, backward and the optimizer; torch.profiler attributes the engine's passes over "
          "gradient memory inside backward; a plain module's backward is the compute. *Exposed + other* is "
          "the rest of backward: waiting for collectives, bookkeeping, and compute slowed by collectives "
          "sharing the cores. *Hidden* = the same buckets all-reduced alone, less the exposed part (not "
          "part of the step). One window per engine: noisier than the timed ratios above.", "",
          "| model | accum | engine | " + " | ".join(PHASES) + " | total | hidden |",
          "|" + "---|" * (len(PHASES) + 5)]
    for row in rows:
        for e, b in row["breakdown"]["engines"].items():
            md.append(f"| {row['model']} | {row['accum']} | {e} | " + " | ".join(_ms(b[k]) for k in PHASES)
                      + f" | {_ms(b['total'])} | {_ms(b['communication hidden'])} |")
    return md + [""]
