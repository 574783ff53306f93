"""Who a replica is, and how the others learn that it is gone, with or without ``gradsync run``.

``gradsync run`` gives each replica its id, restart count and job in the environment and reports its
exit. Under another launcher (``torchrun``, ``srun``, a Kubernetes pod) the replica finds out for
itself from the coordinator (``gradsync coordinator``):

- its **job**: the coordinator's job id; a replica whose ``GRADSYNC_JOB_ID`` names another job is refused;
- its **replica id**: the coordinator hands out 0, 1, 2, ... in order of first arrival, one per
  (``GRADSYNC_GROUP``, ``LOCAL_RANK``), and the same id again to that pair after a restart;
- its **restart**: how many times that id started before (0 on the first start);
- its **liveness**: a thread writes a counter to ``gradsync/beat/<id>/<restart>`` every 0.5 s; a member whose beat
  stood still for ``STALE`` seconds is taken for gone (a SIGKILLed or frozen process). The replica
  also reports its own exit (``gradsync/exit/<id>/<restart>``) when it ends normally, by an uncaught
  exception or by SIGTERM (what torchrun sends the rest of a group it restarts), so those cost no wait;
  a failed replica, or one holding groups of earlier generations, then ends at once (``os._exit``, after
  the atexit handlers registered after ``init_process_group``), not after gloo's timeout.
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .etcd import EtcdStore, parse
from .membership import FAILED, P, STALE, MembershipError

BEAT_S = 0.5
FINISHED, JOB_ID = f"{P}/job/finished", f"{P}/job/id"


class AdmissionError(MembershipError):
    """This process may not take part in the job at its coordinator (another job, a duplicate replica)."""


@dataclass(frozen=True)
class Identity:
    replica_id: int
    restart: int
    replicas: int
    min_replicas: int
    machine: int  # the gradsync run launcher it belongs to; -1: none (it beats and reports its own exit)


def connect(address: str, timeout: timedelta) -> dist.Store:
    """A client of the job's store: ``HOST:PORT`` (a ``gradsync coordinator`` or ``gradsync run``'s
    ``TCPStore``) or ``etcd://HOST:PORT,...[/PREFIX]`` (an etcd cluster, ``etcd.py``)."""
    return thread_connection(address, timeout)[0]


def thread_connection(address: str, timeout: timedelta) -> tuple[dist.Store, tuple[int, str] | None]:
    """``connect``, and the TCPStore's socket (None on etcd, or if not told apart), which ``end_thread`` shuts down
    if the thread making calls on it is still inside one at exit."""
    if address.startswith("etcd://"):
        endpoints, prefix = parse(address)
        return EtcdStore(endpoints, prefix, timeout), None
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"gradsync: GRADSYNC_COORDINATOR must be HOST:PORT or etcd://HOST:PORT,..., got {address!r}")
    before = open_sockets()
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    sock = store_socket(open_sockets() - before, address)
    bound(sock, timeout)
    return store, sock


def bound(sock: tuple[int, str] | None, timeout: timedelta) -> None:
    """Make a TCPStore call on ``sock`` fail once the coordinator has not answered for ``timeout``: TCPStore's own
    timeout bounds only its waits for keys, and a coordinator that is frozen, or cut off without a reset, would
    keep every other call waiting for good (its waits poll first, so they keep their own timeouts)."""
    if sock is None:
        return
    seconds = max(timeout.total_seconds(), 1.0)
    value = struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))
    with socket.socket(fileno=os.dup(sock[0])) as conn:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


def end_thread(thread: threading.Thread, sock: tuple[int, str] | None) -> None:
    """Join a thread of ``thread_connection`` (told to stop) before the interpreter ends: a daemon thread whose
    TCPStore call returns after that aborts the process (rc 134). A call to a coordinator that does not answer
    waits until the connection's bound (``bound``: its timeout), so its connection is shut down: the call fails now."""
    thread.join(timeout=1)
    if thread.is_alive() and sock is not None and sock in open_sockets():  # still the thread's, not a reused number
        with socket.socket(fileno=os.dup(sock[0])) as conn:
            conn.shutdown(socket.SHUT_RDWR)
        thread.join(timeout=10)


def open_sockets() -> set[tuple[int, str]]:
    """(descriptor, ``socket:[inode]``) of this process's open sockets (Linux; elsewhere none)."""
    found = set()
    for fd in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else ():
        try:
            if (link := os.readlink(f"/proc/self/fd/{fd}")).startswith("socket:"):
                found.add((int(fd), link))
        except OSError:  # closed since the listing (the listing's own descriptor)
            continue
    return found


def store_socket(new: set[tuple[int, str]], address: str) -> tuple[int, str] | None:
    """The one new TCP connection to ``address``'s port among ``new``, else None (etcd's connections are Python's
    own: nothing to shut down; another thread's new connection to it: unknown)."""
    port, found = address.rpartition(":")[2], []
    for fd, link in new if port.isdigit() else ():
        try:
            with socket.socket(fileno=os.dup(fd)) as conn:
                if conn.type == socket.SOCK_STREAM and conn.getpeername()[1] == int(port):
                    found.append((fd, link))
        except OSError:  # not a socket, or not connected
            continue
    return found[0] if len(found) == 1 else None


def identify(store: dist.Store, env: Any, address: str, timeout: timedelta) -> Identity:
    """This process's identity in the job at ``address``, from ``gradsync run``'s environment or the store."""
    store.wait([JOB_ID], timeout)  # the coordinator writes it first: a replica may arrive before that
    job = store.get(JOB_ID).decode()
    mine = env.get("GRADSYNC_JOB_ID")
    if mine and mine != job:
        raise AdmissionError(f"gradsync: this replica belongs to job {mine!r} (GRADSYNC_JOB_ID), but the "
                             f"coordinator at {address} runs job {job!r}; it was refused before it took part. "
                             "Start it with its own job's coordinator, or set GRADSYNC_JOB_ID to this one's")
    if "GRADSYNC_REPLICA_ID" in env:  # gradsync run
        return Identity(int(env["GRADSYNC_REPLICA_ID"]), int(env.get("GRADSYNC_RESTART", "0")),
                        int(env["GRADSYNC_REPLICAS"]), int(env.get("GRADSYNC_MIN_REPLICAS", "1")),
                        int(env.get("GRADSYNC_MACHINE", "0")))
    group = env.get("GRADSYNC_GROUP") or socket.gethostname()
    local = int(env.get("LOCAL_RANK", "0"))
    key = f"{P}/replica_of/{group}/{local}"
    if store.check([key]):
        rid = int(store.get(key))
        _refuse_a_twin(store, rid, group, local)
    else:  # first arrival of this (group, local rank): the next free id
        rid = int(store.compare_set(key, "", str(store.add(f"{P}/ids", 1) - 1)))
    restart = store.add(f"{P}/incarnation/{rid}", 1) - 1
    store.wait([f"{P}/replicas", f"{P}/min_replicas"], timeout)
    return Identity(rid, restart, int(store.get(f"{P}/replicas")), int(store.get(f"{P}/min_replicas")), -1)


def _refuse_a_twin(store: dist.Store, rid: int, group: str, local: int) -> None:
    """Refuse to be replica ``rid`` while its previous start still beats (two launchers with one group name); a
    previous start that neither reported its exit nor beat for ``STALE`` seconds is gone (a restart after SIGKILL)."""
    before = store.add(f"{P}/incarnation/{rid}", 0) - 1
    beat, since = None, time.monotonic()
    while before >= 0 and time.monotonic() - since <= STALE:  # the members' own judgment of a silent replica
        if store.check([f"{P}/exit/{rid}/{before}"]):
            return
        now = store.add(f"{P}/beat/{rid}/{before}", 0)
        if beat is not None and now != beat:
            raise AdmissionError(f"gradsync: replica {rid} (GRADSYNC_GROUP={group!r}, LOCAL_RANK={local}) is "
                                 "already running in this job; give each launcher (each torchrun) its own "
                                 "GRADSYNC_GROUP")
        beat = now
        time.sleep(0.1)


class Liveness:
    """How a replica ends: fast once it failed or holds groups of earlier generations; a launcher-less one
    (``reports``) also beats and reports its own exit, which ``gradsync run`` does for its replicas."""

    def __init__(self, address: str, ident: Identity, store: dist.Store, reports: bool):
        self.store, self.exit_key, self.reports = store, f"{P}/exit/{ident.replica_id}/{ident.restart}", reports
        self.failed = False
        self.status: Any = None  # what the script gave sys.exit(): the exit code at_exit reports and ends with
        self.graveyard: list[Any] = []  # the membership's earlier groups (membership.py)
        self._stop = threading.Event()
        self._beating: tuple[threading.Thread, tuple[int, str] | None] | None = None
        if reports:  # its own connection: the beat must not queue behind the main thread's store calls
            beat_store, sock = thread_connection(address, timedelta(seconds=30))
            key = f"{P}/beat/{ident.replica_id}/{ident.restart}"
            thread = threading.Thread(target=self._beat, args=(beat_store, key), name="gradsync-heartbeat", daemon=True)
            thread.start()
            self._beating = (thread, sock)
        hook = sys.excepthook

        def excepthook(kind, value, tb):
            self.failed = True
            limit = getattr(store, "timeout", None)
            if isinstance(value, dist.DistNetworkError) and "timeout" in str(value).lower() and limit:  # bound()'s
                print(f"gradsync: the coordinator at {address} did not answer within {limit.total_seconds():g}s "
                      "(frozen, overloaded, or the network to it cut off): this replica ends. Check the coordinator's "
                      "process and the network to it; the timeout is gradsync.elastic.init_process_group's",
                      file=sys.stderr, flush=True)
            hook(kind, value, tb)
        sys.excepthook = excepthook
        exit_ = sys.exit

        def recording_exit(status: Any = None) -> None:  # a SystemExit reaches no hook: at_exit needs its code
            self.status = status
            exit_(status)
        sys.exit = recording_exit
        atexit.register(self.at_exit)
        if reports and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.on_sigterm)

    def _beat(self, store: dist.Store, key: str) -> None:
        beats = 0
        while not self._stop.is_set():
            beats += 1
            try:
                store.set(key, str(beats))  # a put, not an add: nothing to undo when an answer is lost
            except Exception:  # the coordinator is gone: the main thread's next store call says so
                return
            self._stop.wait(BEAT_S)

    def report(self, code: int) -> None:
        self._stop.set()
        if not self.reports:
            return
        try:
            self.store.set(self.exit_key, str(code))
            if code == 0:  # the script returned: the job is finished (the coordinator exits once all ended)
                self.store.set(FINISHED, "1")
        except Exception:
            pass

    def at_exit(self) -> None:
        status = self.status
        code = 1 if self.failed else 0 if status is None else status if isinstance(status, int) else 1
        self.report(code)
        if self._beating is not None:
            end_thread(*self._beating)
        if self.failed or self.graveyard:
            # a group whose collective waits on a gone peer makes the interpreter's exit wait until gloo's
            # timeout (its threads are joined), and torchrun restarts a group only once every worker ended
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def on_sigterm(self, signum, frame) -> None:
        self.failed = True
        self.report(128 + signum)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


__all__ = ["FAILED", "FINISHED", "JOB_ID", "AdmissionError", "Identity", "Liveness", "connect", "end_thread", "identify", "thread_connection"]
