"""Elastic membership: a dead replica does not end the job; the survivors re-form and finish the window.

``gradsync run`` (``tools/elastic/run.py``) or another launcher with a ``gradsync coordinator`` starts the
replicas; the store (torch's ``TCPStore`` on no replica, or an etcd cluster) holds the membership.
``init_process_group`` forms generation 0 once every replica has arrived and makes it torch's default
process group; a gradsync model built on it follows every later generation (``engine/protocol.py``).
Each synced backward ends with a vote in the store: the gradients are written back only once every
member holds the whole reduction. When a member dies (its exit reported, or its heartbeat stood still)
or a collective fails, the survivors abort the reduction, agree on who is left, build the next
generation's group from ``PrefixStore``, and reduce their own windows again in it: the window closes
over exactly what the survivors processed.

Store keys (under ``gradsync/``): ``exit/<id>/<restart>`` (the launcher, or the replica itself, when a
process ends), ``heartbeat/<launcher>`` and ``beat/<id>/<restart>`` (``identity.py``),
``gen<g>/alive/<id>`` (a member reached generation g; the value is its restart count and launcher),
``gen<g>/members``, ``gen<g>/broken``, ``gen<g>/vote/<sync>/<id>``, ``gen<g>/decision/<sync>``,
``job/id``, ``job/started``, ``job/finished``, ``job/failed``, ``waiting/<id>`` (a replica
that arrived after the start), ``join/...``, ``admitted/...`` and ``refused/...`` (``join.py``).
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .. import process
from .._torch import abort_group, detach_default_group, is_future
from ..engine.control import bounded_wait
from ..engine.errors import PeerFailure, SyncError

P = "gradsync"
FAILED = f"{P}/job/failed"  # why the job ended (identity.py names the job's other keys)
SLICE = 0.1  # seconds between looks at the store while a collective or a vote is not done
STALE = 5.0  # a heartbeat (every 0.5 s) that stood still this long: its launcher's replicas, or its replica, are gone
log = logging.getLogger("gradsync.elastic")


class MembershipError(SyncError):
    """Too few replicas are left, or this replica is no longer a member."""


@dataclass(frozen=True)
class MembershipEvent:
    """One membership change, the same on every member."""

    generation: int  # the generation it formed
    window: int  # the accumulator's window (0-based) whose reduction it re-formed; else the synced backward
    left: list[int]
    joined: list[int]
    micro_steps_lost: int  # the micro-steps of that window the replicas that left were to run, not synced
    seconds: float  # from the failure seen here to the new group
    committed: int = 0  # micro-steps of that window each of them had synced (sync_each_batch): kept


class Heartbeats:
    """When each heartbeat counter in the store last moved, as seen from here."""

    def __init__(self, store: dist.Store):
        self.store = store
        self.moved: dict[str, tuple[int, float]] = {}  # key -> (its count, when it last changed)

    def look(self, key: str) -> tuple[int, float]:
        """``key``'s count, and the seconds it has stood still since it last changed here (0 at the first look)."""
        count, now = self.store.add(key, 0), time.monotonic()
        last = self.moved.get(key)
        if last is None or last[0] != count:
            self.moved[key] = (count, now)
            return count, 0.0
        return count, now - last[1]


class StoreMembership:
    """Generations of members over a coordinator ``TCPStore``: a commit protocol (``engine/protocol.py``)."""

    def __init__(self, store: dist.Store, *, backend: str, replica_id: int, restart: int, replicas: int,
                 min_replicas: int, timeout: timedelta, machine: int = 0):
        self.store, self.backend, self.timeout = store, backend, timeout
        self.replica_id, self.restart, self.machine = replica_id, restart, machine
        self.replicas, self.min_replicas = replicas, min_replicas
        self.generation = 0
        self.members: list[int] = []
        self.incarnation: dict[int, int] = {}  # member id -> its restart count in this generation
        self.machine_of: dict[int, int] = {}  # member id -> its launcher
        self.heartbeats = Heartbeats(store)
        self.events: list[MembershipEvent] = []
        self.joining = False  # arrived after the job started and not admitted yet (elastic_join.py)
        self.joins_seen = 0  # join requests this member has decided on
        self.registered: dict[str, Any] = {}  # name -> object with state_dict()/load_state_dict(), sent to joiners
        self.bytes_per_join: list[int] = []  # what each admission sent every joiner
        self.join_waits: list[float] = []  # on a joiner: seconds from asking to being admitted
        self.graveyard: list[Any] = []  # earlier groups, kept referenced (see detach_default_group)
        self._failed_at: float | None = None
        self.window_source: Any = None  # a weak method of the accumulator: (windows started, planned), attach.py
        self.liveness: Any = None  # how this replica ends, and without a launcher its heartbeat (identity.py)
        self.stop_requested = False  # this replica received SIGUSR1: it carries that in its synced backwards' headers
        self.stopping = False  # the members' last header carried a stop: the job stops at this boundary
        self.requests: Any = None  # join.Requests: the join requests the first member read

    def key(self, name: str, generation: int | None = None) -> str:
        return f"{P}/gen{self.generation if generation is None else generation}/{name}"

    # ---------------------------------------------------------------- generation 0
    def form_first(self) -> None:
        """Wait for every replica, then form generation 0; a replica arriving later joins at a window
        boundary (``elastic_join.py``): until then it trains alone, on a group of its own."""
        if self.store.check([f"{P}/job/started"]):
            self.joining, self.generation = True, -1
            dist.init_process_group(self.backend, store=dist.PrefixStore(f"{P}/solo/{self.replica_id}/{self.restart}",
                                                                         self.store), rank=0, world_size=1,
                                    timeout=self.timeout)  # the model built on it takes its timeout from it
            return
        self.store.set(self.key(f"alive/{self.replica_id}"), self._alive_value())
        ids = list(range(self.replicas))
        keys, deadline = [self.key(f"alive/{i}") for i in ids], time.monotonic() + self.timeout.total_seconds()
        while not self.store.check(keys) and time.monotonic() < deadline:
            if self.store.check([FAILED]):  # e.g. a replica that ended before it arrived, with no restarts left
                raise MembershipError(f"gradsync: the job failed before it started: {self.store.get(FAILED).decode()}")
            time.sleep(0.05)
        self.store.wait(keys, timedelta(seconds=1))  # all in, or the store's error naming the missing keys
        self.store.compare_set(f"{P}/job/started", "", "1")
        self._adopt(ids)

    def enter(self, g: int, ids: list[int]) -> None:
        """Become a member of generation ``g`` of ``ids`` (an admission, on members and joiners alike)."""
        self.store.set(self.key(f"alive/{self.replica_id}", g), self._alive_value())
        self.generation = g
        self._adopt(ids)

    def _adopt(self, ids: list[int]) -> None:
        """Become a member of this generation's ``ids``: read their restart counts, build the group."""
        self.members = sorted(ids)
        values = self.store.multi_get([self.key(f"alive/{i}") for i in self.members])
        rows = [v.decode().split(":") for v in values]
        self.incarnation = {i: int(row[0]) for i, row in zip(self.members, rows)}
        self.machine_of = {i: int(row[1]) for i, row in zip(self.members, rows)}
        old = detach_default_group()
        if old is not None:
            self.graveyard.append(old)
        dist.init_process_group(self.backend, store=dist.PrefixStore(self.key("pg"), self.store),
                                rank=self.members.index(self.replica_id), world_size=len(self.members),
                                timeout=self.timeout)

    # ---------------------------------------------------------------- what the reducer asks
    def wait(self, handle: Any, timeout: timedelta) -> None:
        """Wait in slices; between them, end at once if the group is broken or a member exited."""
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            step = min(SLICE, max(deadline - time.monotonic(), 0.001))
            try:
                bounded_wait(handle, timedelta(seconds=step))
                return
            except Exception:
                if _finished(handle):  # it ended as the slice did, or failed (a peer's connection closed)
                    bounded_wait(handle, timedelta(seconds=1))  # returns, or raises the collective's error
                    return
            gone = self._gone()
            if gone:
                raise PeerFailure(f"gradsync: {gone}")
            if time.monotonic() >= deadline:
                raise TimeoutError("operation timed out")

    def _gone(self) -> str:
        """Why the group cannot finish a collective ('' while it can)."""
        if self.store.check([self.key("broken")]):
            return f"a member of generation {self.generation} stopped using its group"
        for m in self.members:
            if m != self.replica_id and self._exited(m):
                return f"replica {m} exited"
        return ""

    def _alive_value(self) -> str:
        return f"{self.restart}:{self.machine}"

    def _exited(self, m: int) -> bool:
        """Member ``m``'s process ended (its launcher said so), or its launcher stopped beating."""
        if self.store.check([f"{P}/exit/{m}/{self.incarnation.get(m, -1)}"]):
            return True
        machine = self.machine_of.get(m)
        if machine is None or machine == self.machine >= 0:
            return False
        # a replica without a launcher beats itself (identity.py); else its launcher beats for it
        key = f"{P}/beat/{m}/{self.incarnation.get(m, -1)}" if machine < 0 else f"{P}/heartbeat/{machine}"
        beats, still = self.heartbeats.look(key)
        return beats > 0 and still > STALE

    def broken(self, failure: BaseException) -> None:
        if self._failed_at is None:
            self._failed_at = time.monotonic()
        self.store.set(self.key("broken"), str(self.replica_id))

    def commit(self, sync: int) -> bool:
        """Vote (a put: nothing to wait for), wait for every member's vote, then the store's first answer decides:
        "commit" from a member that saw every vote, or "abort" from one that gave up waiting."""
        decision = self.key(f"decision/{sync}")
        self.store.set(self.key(f"vote/{sync}/{self.replica_id}"), "1")
        votes = [self.key(f"vote/{sync}/{m}") for m in self.members]
        deadline = time.monotonic() + self.timeout.total_seconds()
        while True:
            try:
                self.store.wait(votes, timedelta(seconds=SLICE))
                return self.store.compare_set(decision, "", "commit") == b"commit"
            except dist.DistStoreError:
                pass
            if self.store.check([decision]):  # another member decided (gave up) while this one waited: read it
                # a compare_set against a value it never holds reads it in one round trip (get waits first)
                return self.store.compare_set(decision, "?", "?") == b"commit"
            if self._gone() or time.monotonic() >= deadline:
                return self.store.compare_set(decision, "", "abort") == b"commit"

    def reform(self, failure: BaseException, sync: int, committed: bool = False) -> dist.ProcessGroup:
        source = self.window_source() if self.window_source is not None else None
        window = source() if source is not None else None  # (windows started, micro-steps planned, synced)
        if committed and window:  # the window's synced backward committed: the replicas left before the next
            window = (window[0] + 1, 0, 0)
        start = self._failed_at or time.monotonic()
        if not committed and self.store.compare_set(self.key(f"decision/{sync}"), "", "abort") == b"commit":
            raise SyncError(f"gradsync: synced backward {sync} committed on every member, yet this member "
                            "did not finish it; this is a bug in gradsync") from failure
        if self.backend == "nccl":  # a CPU wait was sliced; a kernel on the stream waits until aborted
            abort_group(dist.group.WORLD)
        before, g = list(self.members), self.generation + 1
        while True:  # a member that dies while the next group forms costs one more generation
            self.store.set(self.key(f"alive/{self.replica_id}", g), self._alive_value())
            agreed = self._agree(g, before)
            if self.replica_id not in agreed:
                raise MembershipError(f"gradsync: replica {self.replica_id} was left out of generation {g} "
                                      f"(members {agreed}): the others took it for gone") from failure
            if len(agreed) < self.min_replicas:
                reason = (f"only replicas {agreed} are left in generation {g}, fewer than --min-replicas "
                          f"{self.min_replicas}")
                self.store.set(f"{P}/job/failed", reason)
                raise MembershipError(f"gradsync: {reason}; the job ends") from failure
            self.generation = g
            try:
                self._adopt(agreed)
                break
            except (RuntimeError, dist.DistError) as exc:  # connecting the new group failed
                failure, g = exc, g + 1
        left = [m for m in before if m not in self.members]
        lost = 0 if committed else len(left) * (window[1] - window[2] if window else 1)
        event = MembershipEvent(generation=g, window=window[0] - 1 if window else sync, left=left, joined=[],
                                micro_steps_lost=lost, committed=window[2] if window else 0,
                                seconds=self.slowest(time.monotonic() - start))
        self.events.append(event)
        self._failed_at = None
        log.warning("gradsync.elastic: generation %d: replica(s) %s left in window %d (%d micro-steps lost); "
                    "members %s; re-formed in %.2f s", g, left, event.window, lost, self.members, event.seconds)
        return dist.group.WORLD

    def slowest(self, seconds: float) -> float:
        """The longest any member took from the failure it saw to the new group: the same on every member (one that
        dies before it writes is left out: the next collective finds it gone and re-forms again)."""
        self.store.set(self.key(f"seconds/{self.replica_id}"), f"{seconds:.4f}")
        wrote = self._each(self.members, lambda m: self.key(f"seconds/{m}"))
        return max(float(v) for v in self.store.multi_get([self.key(f"seconds/{m}") for m in wrote]))

    def _agree(self, g: int, before: list[int]) -> list[int]:
        """Wait until every member of the last generation arrived in generation ``g`` or is gone; the
        first proposal written wins, so every survivor adopts the same list."""
        arrived = [m for m in self._each(before, lambda m: self.key(f"alive/{m}", g)) if not self._exited(m)]
        return json.loads(self.store.compare_set(self.key("members", g), "", json.dumps(arrived)))

    def _each(self, members: list[int], key_of: Callable[[int], str]) -> list[int]:
        """Wait, at most the timeout, until each of ``members`` wrote its key or is gone; return those that wrote."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        while True:
            wrote = [m for m in members if self.store.check([key_of(m)])]
            if time.monotonic() >= deadline or all(m in wrote or self._exited(m) for m in members):
                return wrote
            time.sleep(0.01)


def _finished(handle: Any) -> bool:
    return handle.done() if is_future(handle) else handle.is_completed()


def _current() -> StoreMembership:
    if process.state.replica is None:
        raise RuntimeError("gradsync: call gradsync.elastic.init_process_group() first")
    return process.state.replica


def membership() -> StoreMembership:
    """This process's membership (its generation, join figures); after ``init_process_group``."""
    return _current()


def register(name: str, obj: Any) -> None:
    """Send ``obj``'s ``state_dict()`` to every replica that joins (``load_state_dict`` there): e.g. a data
    loader's position or an RNG. Register the same names on every replica before the first window."""
    if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
        raise TypeError(f"gradsync: register() needs an object with state_dict() and load_state_dict(), got "
                        f"{type(obj).__name__}")
    _current().registered[str(name)] = obj


def replica_id() -> int:
    """This replica's id: unique in the job and the same across its restarts."""
    return _current().replica_id


def stopping(acc: Any = None) -> bool:
    """Whether the job stops at this window boundary: a replica received SIGUSR1 (SLURM's ``--signal``
    before the time limit), and every member stops at the same boundary, within one window. ``ElasticSampler``
    ends there by itself; a loop of your own asks between windows (``acc``: the accumulator, whose boundary
    work runs first), saves its checkpoint and returns."""
    if acc is not None:
        acc.at_window_start()
    return _current().stopping


def members() -> list[int]:
    """The sorted replica ids of the current membership, the same on every member."""
    return list(_current().members)


def events() -> list[MembershipEvent]:
    """The membership changes seen so far, the same list on every member."""
    return list(_current().events)


__all__ = ["Heartbeats", "MembershipError", "MembershipEvent", "StoreMembership", "events", "members", "membership",
           "register", "replica_id", "stopping"]
