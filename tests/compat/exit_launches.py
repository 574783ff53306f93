"""Launch exit_script.py's 2-rank jobs as ``gradsync run`` starts replicas: forked from gradsync's fork server.

    python exit_launches.py OUT.json LOG_DIR LAUNCH_TIMEOUT PARALLEL VARIANT_INDEX...

Each launch is one variant of test_clean_exit.py's list: both ranks get torchrun's environment, each
writes its output to its own log, and the launch is SIGKILLed after LAUNCH_TIMEOUT seconds. A forked rank
ends as any interpreter does (atexit, then Python's shutdown while gloo's threads live), so an abort at
exit shows here as it does in a new interpreter; what it saves is importing torch in every rank.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

from gradsync.tools.elastic.forkserver import ForkServer

SCRIPT = Path(__file__).with_name("exit_script.py")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    out, logs, timeout, parallel = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    variants = [json.loads(v) for v in sys.argv[5:]]
    server = ForkServer()
    waiting, running, done = list(enumerate(variants)), [], []
    while waiting or running:
        while waiting and len(running) < parallel:
            i, args = waiting.pop(0)
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
                   "LOCAL_WORLD_SIZE": "2"}
            procs = [server.spawn([str(SCRIPT), *args], {**env, "RANK": str(r), "LOCAL_RANK": str(r),
                                                         "EXIT_SCRIPT_LOG": str(logs / f"launch{i}.rank{r}.log")})
                     for r in range(2)]
            running.append((i, args, procs, time.monotonic() + timeout))
        for launch in list(running):
            i, args, procs, deadline = launch
            codes = [p.poll() for p in procs]
            timed_out = None in codes and time.monotonic() > deadline
            if timed_out:
                for p in procs:
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGKILL)
                codes = [p.wait() for p in procs]
            if None not in codes:
                running.remove(launch)
                output = "".join(log.read_text(errors="replace") for r in range(2)
                                 if (log := logs / f"launch{i}.rank{r}.log").exists())
                done.append({"launch": i, "args": args, "codes": codes, "timed_out": timed_out, "output": output})
        time.sleep(0.05)
    server.close()
    out.write_text(json.dumps(sorted(done, key=lambda d: d["launch"])))


if __name__ == "__main__":
    main()
