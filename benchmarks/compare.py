"""Compare two benchmark records, before and after: paired ratios side by side with each row's A/A band.

    python benchmarks/compare.py results/speed-header-cost-2cpu-2026-11-20.json /tmp/after/speed-header-cost-*.json
    python benchmarks/compare.py results/bench-A.json results/bench-B.json --tolerance 0.03   # two `gradsync bench` runs

Any record a script under benchmarks/ or `gradsync bench` wrote works. Prints a markdown table and
exits 1 when a row moved by more than its A/A band (the noise). The logic is
``gradsync.tools.bench.compare``.
"""
import sys

from gradsync.tools.bench.compare import main

if __name__ == "__main__":
    sys.exit(main())
