"""Do two `gradsync bench` runs agree? Paired ratios to torch's DDP, side by side, with the gap.

    python benchmarks/agreement.py results/bench-A.json results/bench-B.json [--tolerance 0.03]

Prints a markdown table (one row per model, accumulation and engine) and the rows whose paired
ratios differ by more than the tolerance; exits 1 if any do. A ratio is a median over windows
paired round by round, so load that drifts during a run mostly cancels; what is left between two
runs is the noise any single finding has to beat.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def ratios(path: Path) -> dict[tuple[str, int, str], float]:
    record = json.loads(path.read_text())
    return {(m["model"], m["accum"], engine): r for m in record["models"] for engine, r in m["paired_ratio"].items()
            if engine != "torch"}


def compare(a: Path, b: Path, tolerance: float) -> tuple[str, list[tuple]]:
    ra, rb = ratios(a), ratios(b)
    lines = [f"| model | accum | engine | {a.stem} | {b.stem} | gap |", "|---|---|---|---|---|---|"]
    off = []
    for key in sorted(set(ra) & set(rb), key=lambda k: (k[0], k[1], k[2])):
        gap = rb[key] - ra[key]
        mark = " **over**" if abs(gap) > tolerance else ""
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {ra[key]:.3f} | {rb[key]:.3f} | {gap:+.3f}{mark} |")
        if mark:
            off.append(key)
    return "\n".join(lines) + "\n", off


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--tolerance", type=float, default=0.03)
    args = p.parse_args(argv)
    table, off = compare(args.a, args.b, args.tolerance)
    print(table)
    print(f"{len(off)} row(s) differ by more than {args.tolerance:.3f}" + (": " + ", ".join(
        f"{m} acc {k} {e}" for m, k, e in off) if off else ""))
    return 1 if off else 0


if __name__ == "__main__":
    sys.exit(main())
