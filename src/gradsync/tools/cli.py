"""The ``gradsync`` command line: ``gradsync demo``, ``bench``, ``run`` and ``coordinator``."""
from __future__ import annotations

import sys

COMMANDS = {
    "demo": ("gradsync.tools.demo", "train a small model on local ranks and check it against one process"),
    "bench": ("gradsync.tools.bench.run", "benchmark against torch's DDP; write tables and plots to benchmarks/results"),
    "run": ("gradsync.tools.elastic.run", "run a script as elastic replicas that survive a dead replica"),
    "coordinator": ("gradsync.tools.elastic.coordinator",
                    "host the store of an elastic job whose replicas torchrun, srun or Kubernetes starts"),
}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = "\n".join(f"  {name:13s}{help_}" for name, (_, help_) in COMMANDS.items())
        asked = bool(argv) and argv[0] in ("-h", "--help")
        unknown = f"gradsync: unknown command {argv[0]!r}\n" if argv and not asked else ""
        print(f"{unknown}usage: gradsync COMMAND [options]\n\ncommands:\n{lines}", file=sys.stdout if asked else sys.stderr)
        raise SystemExit(0 if asked else 2)
    module = __import__(COMMANDS[argv[0]][0], fromlist=["main"])
    module.main(argv[1:])


if __name__ == "__main__":
    main()
