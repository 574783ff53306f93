"""PNG plots of a ``gradsync bench`` record: step time vs model size, peak memory, bucket timeline."""
from __future__ import annotations

import os

MiB = 1024 * 1024
ENGINE_COLORS = {"gradsync": "tab:blue", "torch": "tab:orange", "torch-views": "tab:brown", "naive": "tab:green",
                 "gradsync-bf16": "tab:purple", "gradsync-sharded": "tab:red"}


def draw(record: dict, out_dir: str, stem: str) -> dict[str, str]:
    """Write the plots the record has data for; return {title: path} (empty without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    paths = {}
    for title, suffix, plot in (("step time vs model size", "steptime", _steptime),
                                ("peak memory", "memory", _memory),
                                ("per-bucket timeline", "timeline", _timeline),
                                ("step breakdown", "breakdown", _breakdown)):
        fig = plot(plt, record)
        if fig is not None:
            path = os.path.join(out_dir, f"{stem}-{suffix}.png")
            fig.tight_layout()
            fig.savefig(path, dpi=110)
            plt.close(fig)
            paths[title] = path
    return paths


def plain_log_labels(axis) -> None:
    """Label a log axis 0.1, 1, 10 (not 10^-1); label minor ticks only when it spans about a decade."""
    from matplotlib.ticker import FuncFormatter, LogFormatter
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.4)))


def _steptime(plt, record: dict):
    if not record["sweep"]:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["params"] for r in record["sweep"]]
    for e in record["sweep"][0]["times"]:
        med = [1e3 * r["times"][e]["median"] for r in record["sweep"]]
        lo = [m - 1e3 * r["times"][e]["min"] for m, r in zip(med, record["sweep"])]
        hi = [1e3 * r["times"][e]["max"] - m for m, r in zip(med, record["sweep"])]
        ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, label=e, color=ENGINE_COLORS.get(e))
    ax.set(xscale="log", yscale="log", xlabel="parameters", ylabel="step time, ms (median, min-max)",
           title=f"MLP step time vs size, {record['world']} gloo ranks")
    plain_log_labels(ax.yaxis)
    ax.legend()
    return fig


def _memory(plt, record: dict):
    rows = record["memory"]
    if not rows:
        return None
    # horizontal bars: the configuration names are too long to sit side by side under vertical ones
    fig, ax = plt.subplots(figsize=(7, 1.3 + 0.3 * len(rows)))
    ys = range(len(rows))
    bars = ax.barh(ys, [r["peak_bytes"] / MiB for r in rows],
                   color=[ENGINE_COLORS.get(r["engine"], "tab:gray") for r in rows])
    ax.bar_label(bars, fmt="%.0f", padding=3, fontsize=7)
    ax.set_yticks(ys, [f"{r['engine']}, {'views' if r['view'] else 'no views'}, "
                       f"set_to_none={r['set_to_none']}" for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.margins(x=0.1)
    ax.set(xlabel="peak RSS above the baseline, MiB",
           title=f"steady-state peak memory, {record.get('memory_model')}")
    return fig


def _timeline(plt, record: dict):
    traced = [r for r in record["models"] if r.get("trace")]
    if not traced:
        return None
    row = max(traced, key=lambda r: (r["grad_bytes"], -r["accum"]))
    it = row["trace"][-1]
    t0 = it["backward_start"]
    fig, ax = plt.subplots(figsize=(7, 2.2 + 0.3 * len(it["buckets"])))
    for b in it["buckets"]:
        first = b["index"] == 0
        if {"launch", "done"} <= b.keys():
            ax.barh(b["index"], 1e3 * (b["done"] - b["launch"]), left=1e3 * (b["launch"] - t0),
                    color="tab:blue", label="launch..done" if first else None)
        if "ready" in b:
            ax.plot(1e3 * (b["ready"] - t0), b["index"], "k|", markersize=14, label="ready" if first else None)
    ax.axvline(1e3 * (it["backward_end"] - t0), color="tab:red", linestyle="--", label="backward returns")
    ax.set_yticks([b["index"] for b in it["buckets"]])
    ax.set(xlabel="ms since the first gradient hook", ylabel="bucket",
           title=f"gradsync buckets, {row['model']}, accumulation {row['accum']}")
    ax.invert_yaxis()
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7)  # beside: bars may fill the axes
    return fig


def _breakdown(plt, record: dict):
    from .breakdown import PHASES
    rows = [r for r in record["models"] if r.get("breakdown")]
    if not rows:
        return None
    colors = plt.get_cmap("tab10").colors
    fig, axes = plt.subplots(len(rows), 1, figsize=(8, 0.9 + 1.9 * len(rows)), squeeze=False)
    for ax, row in zip(axes[:, 0], rows):
        engines = row["breakdown"]["engines"]
        for y, (name, b) in enumerate(engines.items()):
            left = 0.0
            for k, phase in enumerate(PHASES):
                ax.barh(y, 1e3 * b[phase], left=left, color=colors[k], label=phase if y == 0 else None)
                left += 1e3 * b[phase]
            ax.barh(y, 1e3 * b["communication hidden"], left=left, color="none", edgecolor="gray", hatch="//",
                    label="communication hidden (not in the step)" if y == 0 else None)
        ax.set_yticks(range(len(engines)), list(engines), fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{row['model']}, accumulation {row['accum']}", fontsize=9)
    axes[-1, 0].set_xlabel("ms per optimizer step (profiling pass, rank 0)")
    axes[0, 0].legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7)
    return fig
