"""``gradsync coordinator``: the store of an elastic job whose replicas another launcher starts.

torchrun, ``srun`` or a Kubernetes Job starts the replicas, with ``GRADSYNC_COORDINATOR=HOST:PORT``
pointing here; each finds its replica id, restart count and job in this store
(``gradsync/elastic/identity.py``), beats in it, and reports its own exit. The coordinator holds no
replica: run it on a host that outlives them, or give it an etcd cluster (``--coordinator etcd://...``),
which then holds the store and outlives any one host. It exits 0 once the job has finished (the script
returned on a member) and every replica has ended, 1 if the job failed.

``host_store`` is also how ``gradsync run`` hosts its store.
"""
from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
import time
import uuid
from datetime import timedelta

import torch.distributed as dist

from gradsync.elastic.identity import FAILED, FINISHED, JOB_ID, P, connect
from gradsync.elastic.membership import STALE, Heartbeats
DRAIN_S = 60.0  # after the job ended, how long to wait for replicas to end before exiting anyway
CONNECT_S = 60.0  # gradsync run: how long a launcher waits for the coordinator (hosted by a launcher maybe later)


def host_store(host: str, port: int) -> tuple[dist.TCPStore, socket.socket]:
    """Host torch's ``TCPStore`` listening on ``host`` only (torch's own server would listen on every
    interface): the store has no authentication, so it listens where it is told. Keep the socket open:
    the server listens on its descriptor."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(1024)
        store = dist.TCPStore(host, sock.getsockname()[1], is_master=True, wait_for_workers=False,
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    return store, sock


def bounded_connect(coordinator: str | None) -> tuple[dist.TCPStore, str, socket.socket | None]:
    """``reach`` within ``CONNECT_S`` (and a few seconds): a listener that is no store accepts and never answers,
    and the store client's handshake has no bound of its own."""
    done: list = []
    thread = threading.Thread(target=lambda: done.append(_outcome(reach, coordinator)), daemon=True)
    thread.start()
    thread.join(CONNECT_S + 5)
    if not done:
        raise SystemExit(f"gradsync run: nothing answered as a coordinator at {coordinator} within {CONNECT_S + 5:g} s "
                         "(is another program listening there?)")
    if isinstance(done[0], BaseException):
        raise done[0]
    return done[0]


def _outcome(fn, *args):  # fn's result, or the exception it raised
    try:
        return fn(*args)
    except BaseException as exc:  # noqa: B036 - re-raised in the caller's thread
        return exc


def reach(coordinator: str | None) -> tuple[dist.TCPStore, str, socket.socket | None]:
    """Host or join the coordinator store; return it, its address and, where this process hosts it, the
    socket its server listens on (keep it open)."""
    if coordinator is None:
        store, sock = host_store("127.0.0.1", 0)
        return store, f"127.0.0.1:{store.port}", sock
    if coordinator.startswith("etcd://"):  # an etcd cluster holds it: no launcher hosts anything
        return connect(coordinator, timedelta(seconds=CONNECT_S)), coordinator, None
    host, _, port_text = coordinator.rpartition(":")
    port = int(port_text)
    try:
        socket.gethostbyname(host)
    except OSError as exc:  # the store's client would retry the lookup for a minute, then raise from C++
        raise SystemExit(f"gradsync run: --coordinator {coordinator}: cannot resolve {host!r} ({exc})") from None
    # only try to host it where HOST names this machine; otherwise every machine would host its own store
    if _is_local(host):
        try:
            store, sock = host_store(socket.gethostbyname(host), port)
            return store, coordinator, sock
        except (RuntimeError, OSError):
            pass  # another launcher on this machine hosts it
    # the client retries connecting until its timeout: the host's launcher may start later
    return connect(coordinator, timedelta(seconds=CONNECT_S)), coordinator, None  # its calls bounded too


def _is_local(host: str) -> bool:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((socket.gethostbyname(host), 0))
        return True
    except OSError:
        return False


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gradsync coordinator", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1; give this host's private address for "
                             "replicas on other machines: the store has no authentication)")
    parser.add_argument("--port", type=int, default=29400, help="port to listen on (default 29400; 0: any free)")
    parser.add_argument("--replicas", type=int, required=True, help="replicas that form the job at its start")
    parser.add_argument("--min-replicas", type=int, default=1, help="fewest replicas the job may go on with")
    parser.add_argument("--coordinator", metavar="etcd://HOST:PORT,...[/PREFIX]", default=None,
                        help="keep the job's store on this etcd cluster instead of hosting it: no host's death "
                             "ends the job, this process's included (replicas get the same GRADSYNC_COORDINATOR)")
    parser.add_argument("--job-id", default=None, help="the job's id (default: a new random one); a replica whose "
                        "GRADSYNC_JOB_ID names another job is refused")
    args = parser.parse_args(argv)
    if args.coordinator is not None and not args.coordinator.startswith("etcd://"):
        parser.error(f"--coordinator must be etcd://HOST:PORT,...[/PREFIX], got {args.coordinator!r}")
    if not 0 <= args.port < 65536:
        parser.error(f"--port must be from 0 (any free port) to 65535, got {args.port}")
    if args.replicas < 1 or not 1 <= args.min_replicas <= args.replicas:
        parser.error(f"need 1 <= --min-replicas <= --replicas, got {args.min_replicas} and {args.replicas}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sock = None
    if args.coordinator is not None:  # the store is etcd's; a coordinator that restarts finds its job there
        store, where = connect(args.coordinator, timedelta(seconds=60)), f"etcd at {args.coordinator[7:]}"
    else:
        try:
            store, sock = host_store(args.host, args.port)
        except OSError as exc:
            print(f"gradsync coordinator: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
            raise SystemExit(2) from exc
        where = f"listening on {args.host}:{store.port}"
    store.compare_set(f"{P}/replicas", "", str(args.replicas))
    store.compare_set(f"{P}/min_replicas", "", str(args.min_replicas))
    job = store.compare_set(JOB_ID, "", args.job_id or uuid.uuid4().hex[:12]).decode()
    print(f"gradsync coordinator: {where}, job {job}; waiting for {args.replicas} replicas (the job goes on "
          f"with at least {args.min_replicas})", flush=True)
    received: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: received.append(signum))
    while not received and not store.check([FINISHED]) and not store.check([FAILED]):
        time.sleep(0.1)
    drain(store, received)
    if received:
        raise SystemExit(128 + received[0])
    if sock is not None:
        sock.close()
    if store.check([FAILED]):
        print(f"gradsync coordinator: the job failed: {store.get(FAILED).decode()}", file=sys.stderr)
        raise SystemExit(1)
    print(f"gradsync coordinator: job {job} finished", flush=True)


def drain(store: dist.TCPStore, received: list[int]) -> None:
    """Wait until every replica's latest start has reported its exit or stopped beating (bounded)."""
    heartbeats = Heartbeats(store)
    deadline = time.monotonic() + DRAIN_S
    while not received and time.monotonic() < deadline:
        running = 0
        for rid in range(store.add(f"{P}/ids", 0)):
            start = store.add(f"{P}/incarnation/{rid}", 0) - 1
            if start < 0 or store.check([f"{P}/exit/{rid}/{start}"]):
                continue
            running += heartbeats.look(f"{P}/beat/{rid}/{start}")[1] <= STALE
        if not running:
            return
        time.sleep(0.1)


__all__ = ["host_store", "main"]


if __name__ == "__main__":
    main()
