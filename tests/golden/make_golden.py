"""Write tests/golden/golden.pt: every configuration of configs.py, run twice (both runs must agree bit
for bit), saved per configuration, rank and step.

Generate it from a pristine checkout of the engine you want to pin, never from a tree being edited:

    git worktree add /tmp/golden-base HEAD
    PYTHONPATH=/tmp/golden-base/src python tests/golden/make_golden.py [--out tests/golden/golden.pt]

It prints the gradsync it imported; check that it is the intended one.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(1, str(HERE))  # configs.py; PYTHONPATH (the engine to pin) stays ahead of it

import torch  # noqa: E402

import gradsync  # noqa: E402
import configs  # noqa: E402


def warm() -> None:
    """As tests/conftest.py: one intra-op thread, and torch._dynamo imported before ranks fork."""
    torch.set_num_threads(1)
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.zeros(1)
    torch.optim.SGD([p], lr=0.1, foreach=False).step()


def commit_of(src: Path) -> str:
    """The commit of the checkout that holds ``src``, "-dirty" if ``src`` differs from it."""
    try:
        head = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--", "."],
                               capture_output=True, text=True).stdout.strip()
        return head.stdout.strip() + ("-dirty" if dirty else "")
    except OSError:
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE / "golden.pt"))
    parser.add_argument("--allow-dirty", action="store_true",
                        help="pin an engine whose sources differ from their checkout's commit")
    args = parser.parse_args()
    src = Path(gradsync.__file__).resolve().parents[1]
    commit = commit_of(src)
    print(f"gradsync.__file__ = {gradsync.__file__}")
    print(f"engine commit: {commit}; torch {torch.__version__}; "
          f"cpu capability {torch.backends.cpu.get_cpu_capability()}")
    if commit.endswith("-dirty") and not args.allow_dirty:
        sys.exit(f"{src} has uncommitted changes: generate from a clean checkout (git worktree add), "
                 "or pass --allow-dirty")
    warm()
    runs = []
    for attempt in range(2):
        start = time.monotonic()
        runs.append(configs.run_all())
        print(f"run {attempt + 1}: {len(runs[-1])} tensors in {time.monotonic() - start:.1f} s")
    problems = configs.differences(runs[1], runs[0])
    if problems:
        sys.exit("the two runs differ, the engine is not deterministic here:\n  " + "\n  ".join(problems))
    found = {k.split("/", 1)[0] for k in runs[0]}
    missing = set(configs.CONFIGS) - found
    if missing:
        sys.exit(f"configurations that recorded nothing: {sorted(missing)}")
    configs.save_golden(args.out, runs[0], engine_commit=commit, torch=str(torch.__version__),
                        cpu_capability=torch.backends.cpu.get_cpu_capability())
    size = Path(args.out).stat().st_size
    print(f"wrote {args.out}: {len(runs[0])} tensors, {len(found)} configurations, {size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
