"""Before/after: two benchmark records side by side, each change against the noise of its own rows.

    python benchmarks/compare.py BEFORE.json AFTER.json [--tolerance 0.03]
    python -m gradsync.tools.bench.compare BEFORE.json AFTER.json

Reads a ``gradsync bench`` record (its ``models``) or any record the harness wrote (its ``rows``), and
for every row (model, accumulation, and group/run/world where there is one) and variant present in
both, puts the two paired ratios (each a median of per-round ratios to the row's reference, so load
drifting within a run cancels) side by side with after/before. The **A/A band** of a row is how far
from 1 an A/A pair landed in the two runs: the paired ratio of a variant that is the reference run
again (``torch A/A``, ``off-again``, ``before-again``), or else the interquartile range of the
reference's round-to-round ratios. A change inside the band is noise; the exit status is 1 when any
row moved by more than ``max(band, --tolerance)``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

__all__ = ["rows", "band", "compare", "summary", "main"]

AA_MARKS = ("A/A", "-again", " again")
KEY_FIELDS = ("group", "run", "world", "link")



def _aa_from_raw(raw: dict[str, list[float]], ref: str) -> float | None:
    times = raw.get(ref) or []
    if len(times) < 3:
        return None
    rounds = sorted(a / b for a, b in zip(times[1:], times))
    lo, hi = rounds[len(rounds) // 4], rounds[(3 * len(rounds)) // 4]
    return max(abs(lo - 1), abs(hi - 1))


def band(ratios: dict[str, float], raw: dict | None = None, ref: str | None = None) -> float | None:
    """The row's A/A distance from 1: an A/A variant's paired ratio, else the reference's own spread."""
    aa = [abs(r - 1) for name, r in ratios.items() if any(m in name for m in AA_MARKS)]
    if aa:
        return max(aa)
    return _aa_from_raw(raw or {}, ref) if ref else None


def rows(record: dict) -> dict[str, dict]:
    """Every row of ``record`` by a readable key, with its variants' paired ratios and its A/A band."""
    out: dict[str, dict] = {}
    for r in record.get("models") or record.get("rows") or []:
        ratios = r.get("paired_ratio") or {}
        if not ratios and "summary" in r:  # speed/cluster.py keeps its ratios in a summary
            ratios = r["summary"].get("ratio", {})
        if not isinstance(ratios, dict) or not ratios:
            continue
        key = " ".join([str(r.get("model", "?")), f"acc {r['accum']}" if "accum" in r else ""] +
                       [f"{f} {r[f]}" for f in KEY_FIELDS if f in r]).replace("  ", " ").strip()
        ref = next((n for n, v in ratios.items() if v == 1.0), None)
        out[key] = {"ratios": {n: v for n, v in ratios.items() if n != ref},
                    "band": band(ratios, r.get("raw") or r.get("raw_times"), ref)}
    return out


def compare(before: dict, after: dict, tolerance: float = 0.03) -> tuple[str, list[str]]:
    """The markdown table and the rows (``key: variant``) that moved by more than their band."""
    a, b = rows(before), rows(after)
    lines = ["| row | variant | before | after | after / before | A/A band | |", "|---|---|---|---|---|---|---|"]
    moved = []
    for key in [k for k in a if k in b]:
        bands = [x for x in (a[key]["band"], b[key]["band"]) if x is not None]
        noise = max(bands) if bands else None
        limit = max(noise or 0.0, tolerance)
        for name in [n for n in a[key]["ratios"] if n in b[key]["ratios"] and not any(m in n for m in AA_MARKS)]:
            x, y = a[key]["ratios"][name], b[key]["ratios"][name]
            change = y / x if x else float("nan")
            verdict = "within noise" if abs(change - 1) <= limit else ("slower" if change > 1 else "faster")
            if verdict != "within noise":
                moved.append(f"{key}: {name}")
            lines.append(f"| {key} | {name} | {x:.3f} | {y:.3f} | {change:.3f} | "
                         f"{'±%.3f' % noise if noise is not None else 'n/a'} | {verdict} |")
    shared = [k for k in a if k in b]
    if not shared:
        lines.append("| (no row in both records) | | | | | | |")
    return "\n".join(lines) + "\n", moved


def summary(before: dict, after: dict) -> str:
    """One line: how many rows, and the median after/before over every shared (row, variant)."""
    a, b = rows(before), rows(after)
    changes = [b[k]["ratios"][n] / a[k]["ratios"][n] for k in a if k in b
               for n in a[k]["ratios"] if n in b[k]["ratios"] and a[k]["ratios"][n]]
    if not changes:
        return "no shared rows"
    return f"{len(changes)} (row, variant) pairs; median after/before {statistics.median(changes):.3f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    p.add_argument("--tolerance", type=float, default=0.03,
                   help="a change smaller than this is noise even where the A/A band is narrower")
    args = p.parse_args(argv)
    before, after = (json.loads(path.read_text()) for path in (args.before, args.after))
    table, moved = compare(before, after, args.tolerance)
    print(f"# {args.after.name} against {args.before.name}\n")
    print(table)
    print(summary(before, after))
    print(f"{len(moved)} row(s) moved beyond their A/A band (and {args.tolerance:.3f})"
          + (": " + "; ".join(moved) if moved else ""))
    return 1 if moved else 0


if __name__ == "__main__":
    sys.exit(main())
