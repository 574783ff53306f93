"""``gradsync run``: run a script as elastic replicas that survive a dead replica.

Each launcher starts ``--replicas`` copies of ``python script.py args...`` and keeps a torch
``TCPStore`` (the coordinator) informed: a replica's exit code goes to
``gradsync/exit/<id>/<restart>`` within tens of milliseconds, and a dead replica is restarted with
the same id while it has restarts left and the job has neither finished nor failed.

Several machines each run the same command with ``--machines P --coordinator HOST:PORT``. The
launcher on the machine that owns HOST hosts the store (the first one to bind the port, when
several launchers share a machine); the others connect to it. Replica ids are assigned in blocks
of ``--replicas``, in the order launchers reach the coordinator. If the launcher hosting the
coordinator dies, the job ends: the others lose the store.

On Linux, replicas are forked from a server that has imported torch (``forkserver.py``), so a
replica starts, and restarts, without importing torch again; ``--fresh-interpreters`` starts each
as a new ``python script.py`` instead.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass

from gradsync.elastic.identity import FAILED, FINISHED, JOB_ID, P
from gradsync.elastic.membership import STALE, Heartbeats
from gradsync.tools.elastic.coordinator import CONNECT_S, bounded_connect
from gradsync.tools.elastic.forkserver import Forked, ForkServer, new_interpreter, supported

POLL_S = 0.02  # a death is on the critical path of recovery: report it within tens of ms
HEARTBEAT_S = 0.5
GRACE_S = 5.0  # SIGTERM, then SIGKILL after this long
# a replica stopped by a signal (SIGSTOP) this long is killed: the launcher beats for its machine, so the others'
# heartbeat check cannot tell it from a live one (elastic/membership.py: the same 5 s a silent machine gets)
STOPPED_S = 5.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="gradsync run", description="Run a script as elastic replicas that survive a dead replica.")
    parser.add_argument("--replicas", type=int, default=1, help="replicas this launcher starts (default 1)")
    parser.add_argument("--min-replicas", type=int, default=1,
                        help="fewest replicas the job may go on with (default 1)")
    parser.add_argument("--max-restarts", type=int, default=0, help="restarts per replica (default 0)")
    parser.add_argument("--coordinator", metavar="HOST:PORT",
                        help="the store every launcher shares (default: one on 127.0.0.1, any free port); "
                             "etcd://HOST:PORT,...[/PREFIX]: an etcd cluster's")
    parser.add_argument("--machines", type=int, default=1, help="launchers taking part (default 1)")
    parser.add_argument("--fresh-interpreters", action="store_true",
                        help="start each replica as a new Python process instead of forking it from one that "
                             "has torch imported (a slower start and restart)")
    parser.add_argument("script", help="the Python script each replica runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="passed to the script unchanged")
    args = parser.parse_args(argv)
    if args.replicas < 1 or args.machines < 1:
        parser.error("--replicas and --machines must be at least 1")
    if args.max_restarts < 0:
        parser.error("--max-restarts must be at least 0")
    total = args.replicas * args.machines
    if not 1 <= args.min_replicas <= total:
        parser.error(f"--min-replicas must be between 1 and --replicas x --machines = {total}, "
                     f"got {args.min_replicas}")
    if args.coordinator is not None and not args.coordinator.startswith("etcd://"):
        host, _, port = args.coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            parser.error(f"--coordinator must be HOST:PORT with a port from 1 to 65535, got {args.coordinator!r}")
    elif args.machines > 1:
        parser.error("--machines > 1 needs --coordinator HOST:PORT")
    return args


@dataclass
class Replica:
    rid: int
    proc: subprocess.Popen | Forked
    restart: int = 0
    ended_by_us: bool = False  # the launcher ended it: its exit is no failure
    kill_at: float | None = None  # SIGKILL if still alive then
    returncode: int | None = None
    stopped_polls: int = 0  # consecutive polls that found it stopped
    gave_up: str = ""  # why it ended with no restarts left (before the job started, the others stop waiting)


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal: state T in ``/proc`` (not a debugger's tracing stop, t)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"T"
    except (OSError, IndexError):  # gone, or no /proc: not stopped
        return False


def describe(code: int) -> str:
    if code < 0:
        try:
            return f"died with {signal.Signals(-code).name}"
        except ValueError:
            return f"died with signal {-code}"
    return f"exited with code {code}"


def terminate(rep: Replica, sig: int = signal.SIGTERM) -> None:
    try:
        os.killpg(rep.proc.pid, sig)  # the whole session: the script's own children too
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not (os.path.isfile(args.script) or os.path.isfile(os.path.join(args.script, "__main__.py"))):
        # as python's own message, before anything starts: a replica would fail on it, once per restart
        raise SystemExit(f"gradsync run: can't open file {os.path.abspath(args.script)!r}: no such script")
    # before the store: a hosting store runs a thread, and the server must be forked while there is none
    server = ForkServer() if supported() and not args.fresh_interpreters else None
    try:
        run(args, server)
    finally:
        if server is not None:
            server.close()


def run(args: argparse.Namespace, server: ForkServer | None) -> None:
    store, address, sock = bounded_connect(args.coordinator)
    hosting = sock is not None
    store.compare_set(JOB_ID, "", os.environ.get("GRADSYNC_JOB_ID") or uuid.uuid4().hex[:12])  # the first one's
    machine = store.add("gradsync/machines", 1) - 1
    late = store.check(["gradsync/job/started"])  # its replicas join the running job with new ids
    if machine >= args.machines and not late:
        print(f"gradsync run: {machine + 1} launchers reached {address}, but --machines is {args.machines}",
              file=sys.stderr)
        raise SystemExit(2)
    # ids in blocks, in the order launchers reach the coordinator: m*R .. m*R+R-1 while every launcher
    # has the same --replicas, and never an id twice when a later launcher brings another count
    first_id = store.add("gradsync/ids", args.replicas) - args.replicas
    total = args.replicas * args.machines
    if not late:
        store.set("gradsync/replicas", str(total))
        store.set("gradsync/min_replicas", str(args.min_replicas))
    base_env = {**os.environ, "GRADSYNC_COORDINATOR": address, "GRADSYNC_REPLICAS": str(total),
                "GRADSYNC_MIN_REPLICAS": str(args.min_replicas), "GRADSYNC_MACHINE": str(machine),
                "GRADSYNC_JOB_ID": store.get(JOB_ID).decode()}

    def start(rid: int, restart: int) -> subprocess.Popen | Forked:
        env = {**base_env, "GRADSYNC_REPLICA_ID": str(rid), "GRADSYNC_RESTART": str(restart)}
        if server is not None:
            return server.spawn([args.script, *args.args], env)
        return new_interpreter([args.script, *args.args], env)

    received: list[int] = []

    def on_signal(signum, frame):
        received.append(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    replicas = [Replica(rid, start(rid, 0)) for rid in range(first_id, first_id + args.replicas)]
    try:
        code = supervise(store, args, machine, hosting, replicas, start, received)
    except BaseException as exc:
        end_all(replicas)
        if isinstance(exc, (RuntimeError, OSError)):  # torch's store errors: the coordinator is gone
            print(f"gradsync run: lost the coordinator at {address} ({exc}); ended the replicas", file=sys.stderr)
            raise SystemExit(1) from exc
        raise
    raise SystemExit(code)


def supervise(store, args, machine: int, hosting: bool, replicas: list[Replica], start, received: list[int]) -> int:
    """Report, restart and end replicas until none runs; return the launcher's exit code."""
    heartbeat_at = 0.0
    interrupted_at = None
    while True:
        now = time.monotonic()
        if now >= heartbeat_at:
            store.add(f"gradsync/heartbeat/{machine}", 1)
            heartbeat_at = now + HEARTBEAT_S
        if received and interrupted_at is None:
            interrupted_at = now
            for rep in replicas:
                if rep.returncode is None:
                    rep.ended_by_us, rep.kill_at = True, now + GRACE_S
                    terminate(rep)
        running = [rep for rep in replicas if rep.returncode is None]
        for rep in running:
            code = rep.proc.poll()
            if code is None:
                # counted in polls, not seconds: a launcher stopped with its replicas (a suspended job) and continued
                # with them sees them running again at its next poll
                rep.stopped_polls = rep.stopped_polls + 1 if stopped(rep.proc.pid) else 0
                if rep.stopped_polls >= round(STOPPED_S / POLL_S):
                    print(f"gradsync run: replica {rep.rid} (restart {rep.restart}) has been stopped (SIGSTOP) for "
                          f"{STOPPED_S:g} s; killing it so that the others go on without it", file=sys.stderr)
                    terminate(rep, signal.SIGKILL)
                    rep.stopped_polls = 0  # its restart counts afresh
                continue
            store.set(f"gradsync/exit/{rep.rid}/{rep.restart}", str(code))
            rep.returncode = code
            head = f"gradsync run: replica {rep.rid} (restart {rep.restart}) {describe(code)}"
            if rep.ended_by_us:
                print(f"{head}; ended by the launcher", file=sys.stderr)
            elif code == 0:
                store.set(FINISHED, "1")
            elif store.check([FAILED]):
                print(f"{head}; the job failed, not restarting", file=sys.stderr)
            elif store.check([FINISHED]):
                print(f"{head}; the job finished, not restarting", file=sys.stderr)
            elif args.machines == 1 and sum(r.returncode is None for r in replicas) < args.min_replicas and store.check(
                    [f"{P}/job/started"]):  # the survivors end the job: a restart would find it failed
                print(f"{head}; fewer than --min-replicas {args.min_replicas} remain, not restarting", file=sys.stderr)
            elif rep.restart < args.max_restarts:
                print(f"{head}; restarting ({rep.restart + 1} of {args.max_restarts})", file=sys.stderr)
                rep.restart += 1
                rep.proc, rep.returncode = start(rep.rid, rep.restart), None
            else:
                print(f"{head}; no restarts left", file=sys.stderr)
                rep.gave_up = f"replica {rep.rid} {describe(code)} before the job started, with no restarts left"
        gone = [rep.gave_up for rep in replicas if rep.gave_up]  # the others wait for it to arrive: end their wait
        if gone and any(store.check([f"{P}/gen0/alive/{r.rid}"]) for r in replicas) and not store.check(
                [f"{P}/job/started"]) and not store.check([FAILED]):
            store.set(FAILED, gone[0])
        running = [rep for rep in replicas if rep.returncode is None]
        if not running:
            break
        if interrupted_at is None and store.check([FINISHED]):
            for rep in running:
                key = f"gradsync/waiting/{rep.rid}"
                if not rep.ended_by_us and store.check([key]) and store.get(key).decode() == str(rep.restart):
                    rep.ended_by_us, rep.kill_at = True, now + GRACE_S
                    terminate(rep)
        for rep in running:
            if rep.kill_at is not None and now >= rep.kill_at:
                terminate(rep, signal.SIGKILL)
                rep.kill_at = None
        time.sleep(POLL_S)

    store.set(f"gradsync/launcher_done/{machine}", "1")
    if interrupted_at is not None:
        return 128 + received[0]
    launchers = max(args.machines, store.add("gradsync/machines", 0))  # late launchers included
    if hosting and launchers > 1:
        # the other launchers still need the store: wait for them to finish with it
        others = [m for m in range(launchers) if m != machine]
        heartbeats = Heartbeats(store)
        deadline = time.monotonic() + CONNECT_S
        while others and time.monotonic() < deadline and not received:
            now = time.monotonic()
            if now >= heartbeat_at:
                store.add(f"gradsync/heartbeat/{machine}", 1)
                heartbeat_at = now + HEARTBEAT_S
            for m in list(others):  # done, or dead: its heartbeat stood still (as gradsync.elastic judges it)
                still = heartbeats.look(f"gradsync/heartbeat/{m}")[1]
                if store.check([f"gradsync/launcher_done/{m}"]) or still > STALE:
                    others.remove(m)
            time.sleep(0.1)
        if received:
            return 128 + received[0]
    if store.check([FAILED]):
        print(f"gradsync run: the job failed: {store.get(FAILED).decode()}", file=sys.stderr)
        return 1
    failed = [rep for rep in replicas if not rep.ended_by_us and rep.returncode > 0]
    return 0 if store.check([FINISHED]) and not failed else 1


def end_all(replicas: list[Replica]) -> None:
    """SIGTERM every running replica, then SIGKILL those still alive after the grace period."""
    running = [rep for rep in replicas if rep.proc.poll() is None]
    for rep in running:
        terminate(rep)
    deadline = time.monotonic() + GRACE_S
    while any(rep.proc.poll() is None for rep in running) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    for rep in running:
        if rep.proc.poll() is None:
            terminate(rep, signal.SIGKILL)
            rep.proc.wait()


if __name__ == "__main__":
    main()
