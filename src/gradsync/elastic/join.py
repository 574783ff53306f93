"""Joining a running job at a window boundary (``gradsync.elastic``): admission, and the state sent.

A replica that arrives after the job started (``gradsync run`` restarted it, or a new launcher
brought it) trains on a group of its own until its first window boundary: its first
``acc.accumulate()``, or the first item of ``acc.iterate()`` or of an ``ElasticSampler``. There it
asks to join and waits, ready, so the members pause only for the transfer. The first member's
``Requests`` thread reads the number of join requests from the store, and every member carries what it
read, and whether it was asked to stop (SIGUSR1), in each synced backward's phase header
(``ControlPlane.standing``): at the next window boundary every member reads the same header, so all
stop there, or admit the same joiners into the next generation, without a round trip to the store. The
first member then sends everyone the state: the parameters and buffers, every optimizer and
scheduler the accumulator wrapped, the accumulator's own state, the reducer's counters, the
membership's events and whatever was registered with ``gradsync.elastic.register``.
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import threading
import time
from typing import Any

import torch.distributed as dist

from .. import process
from ..ddp.construct import broadcast_coalesced
from ..engine.collectives import broadcast_bytes, deserialized, serialized
from ..engine.control import CARRIED
from ..engine.errors import PeerFailure
from ..engine.launcher import saved_state
from .identity import FAILED, FINISHED, AdmissionError, end_thread, thread_connection
from .membership import P, MembershipError, MembershipEvent

log = logging.getLogger("gradsync.elastic")
POLL = 0.02  # a waiting joiner looks for its admission this often
REQUESTS_S = 0.1  # the first member reads the number of join requests this often


class Requests:
    """The number of join requests in the store, read by a thread of its own connection while this replica is the
    first member (the others carry 0: the header's maximum is every member's answer)."""

    def __init__(self, m: Any, address: str):
        self.count, self._stop = 0, threading.Event()
        store, self._socket = thread_connection(address, m.timeout)
        self._thread = threading.Thread(target=self._poll, args=(m, store), name="gradsync-requests", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def _poll(self, m: Any, store: dist.Store) -> None:
        while not self._stop.wait(REQUESTS_S):
            try:
                if not m.joining and m.members and m.members[0] == m.replica_id:
                    self.count = store.add(f"{P}/join/count", 0)
            except Exception:  # the coordinator is gone: the main thread's next store call says so
                return

    def close(self) -> None:
        self._stop.set()
        end_thread(self._thread, self._socket)


def standing(m: Any) -> tuple[float, float]:
    """What this member carries in every synced backward's header: join requests read, and a stop asked for."""
    return float(m.requests.count if m.requests is not None else 0), float(m.stop_requested)


def at_boundary(acc: Any) -> None:
    """Admit waiting replicas (on a member) or join (on a replica that arrived late), before a window."""
    m = process.state.replica
    reducer = getattr(acc.model, "reducer", None)
    if m is None or reducer is None or reducer.attached is None or reducer.attached.protocol is not m:
        return
    if m.joining:
        join(m, acc, reducer)
        return
    rows = (reducer.plane.payloads or {}).values()  # the last synced backward's header: the same on every member
    m.stopping = m.stopping or any(row[CARRIED + 1] for row in rows)
    if not m.stopping:  # no admission into a job that stops here
        admit(m, acc, reducer, int(max((row[CARRIED] for row in rows), default=0)))


def admit(m: Any, acc: Any, reducer: Any, agreed: int) -> None:
    """Admit the join requests up to the ``agreed`` one (what the members' header carried)."""
    window = acc.windows  # the 0-based index of the window about to start
    if agreed <= m.joins_seen:
        return
    requests = [m.store.get(f"{P}/join/req/{n}").decode() for n in range(m.joins_seen + 1, agreed + 1)]
    m.joins_seen = agreed
    joiners = dict(tuple(int(v) for v in req.split(":")) for req in requests)  # id -> restart (the latest)
    joiners = {r: s for r, s in joiners.items() if r not in m.members and not m.store.check([f"{P}/exit/{r}/{s}"])
               and admissible(m, acc.model, r, s)}
    if not joiners:
        return
    start, g, source = time.monotonic(), m.generation + 1, m.members[0]
    ids = sorted(m.members + list(joiners))
    for r, s in joiners.items():
        m.store.set(f"{P}/admitted/{r}/{s}", f"{g}:{json.dumps(ids)}:{source}:{json.dumps(sorted(joiners))}")
    try:
        m.enter(g, ids)
        reducer.attached.regroup(dist.group.WORLD)
        sent = transfer(m, acc, reducer, source)
    except (RuntimeError, dist.DistError) as exc:  # a member or joiner died during the admission
        log.warning("gradsync.elastic: admitting %s into generation %d failed (%s); the window's synced "
                    "backward re-forms", sorted(joiners), g, exc)
        reducer.attached.lose_group(exc if isinstance(exc, PeerFailure) else PeerFailure(str(exc)))
        return
    record(m, g, window, sorted(joiners), start, sent)


def join(m: Any, acc: Any, reducer: Any) -> None:
    start = time.monotonic()
    me = f"{m.replica_id}/{m.restart}"
    m.store.set(f"{P}/join/fingerprint/{me}", json.dumps(fingerprint(acc.model)))  # before the request
    n = m.store.add(f"{P}/join/count", 1)
    m.store.set(f"{P}/join/req/{n}", f"{m.replica_id}:{m.restart}")
    m.store.set(f"{P}/waiting/{m.replica_id}", str(m.restart))  # the launcher ends it if the job ends first
    log.warning("gradsync.elastic: replica %d (restart %d) asks to join", m.replica_id, m.restart)
    key = f"{P}/admitted/{me}"
    while not m.store.check([key]):
        if m.store.check([FAILED]):
            raise MembershipError(f"gradsync: the job failed before replica {m.replica_id} could join: "
                                  f"{m.store.get(FAILED).decode()}")
        if m.store.check([f"{P}/refused/{me}"]):
            raise AdmissionError(m.store.get(f"{P}/refused/{me}").decode())
        if m.store.check([FINISHED]) and m.liveness.reports:  # no launcher ends it: it ends itself
            log.warning("gradsync.elastic: the job finished before replica %d could join", m.replica_id)
            raise SystemExit(0)
        time.sleep(POLL)
    m.join_waits.append(time.monotonic() - start)  # asking to admitted: up to one window of the members
    start = time.monotonic()
    g, ids, source, joined = m.store.get(key).decode().split(":")  # joined: everyone admitted with it
    m.store.set(f"{P}/waiting/{m.replica_id}", "admitted")
    m.joining = False
    try:
        m.enter(int(g), json.loads(ids))
        reducer.attached.regroup(dist.group.WORLD, joining=True)  # a sharded model receives its shards here
        sent = transfer(m, acc, reducer, int(source))
    except (RuntimeError, dist.DistError) as exc:
        raise MembershipError(f"gradsync: replica {m.replica_id} could not join generation {g}: {exc}") from exc
    record(m, int(g), acc.windows, json.loads(joined), start, sent)


def fingerprint(model: Any) -> dict[str, Any]:
    """What every replica must agree on: the model's parameters and buffers (names, shapes, dtypes) and the
    wrapper's options."""
    config = model.reducer.config
    tensors = [("parameter", n, t) for n, t in model.module.named_parameters()]
    tensors += [("buffer", n, t) for n, t in model.module.named_buffers()]
    return {"tensors": {f"{kind} {name!r}": f"{tuple(t.shape)} {t.dtype} requires_grad={t.requires_grad}"
                        for kind, name, t in tensors},
            "options": {f.name: repr(getattr(config, f.name)) for f in dataclasses.fields(config) if f.name != "timeout"}}


def admissible(m: Any, model: Any, r: int, s: int) -> bool:
    """Whether joiner ``r`` (start ``s``) runs what the members run; if not, say why in the store. Every member
    decides alike: their models agree, and they read the same fingerprint."""
    theirs = json.loads(m.store.get(f"{P}/join/fingerprint/{r}/{s}"))
    ours = fingerprint(model)
    differences = [f"{name}: {theirs[part].get(name, 'absent')} on replica {r}, {ours[part].get(name, 'absent')} "
                   "on the members" for part in ("tensors", "options")
                   for name in sorted(set(ours[part]) | set(theirs[part]))
                   if theirs[part].get(name) != ours[part].get(name)]
    if not differences:
        return True
    shown = "; ".join(differences[:5]) + (f"; and {len(differences) - 5} more" if len(differences) > 5 else "")
    reason = (f"gradsync: replica {r} was refused at admission: its model or options differ from the members' "
              f"({shown}). Every replica must run the same script and version")
    m.store.set(f"{P}/refused/{r}/{s}", reason)
    if m.store.add(f"{P}/refusing/{r}/{s}", 1) == 1:  # counted once, by the first member to refuse it
        m.store.add(f"{P}/join/refusals", 1)
    log.warning("%s", reason)
    return False


def state_of(m: Any, acc: Any, reducer: Any) -> dict[str, Any]:
    # a ShardedOptimizer's state moved with the shards as the group re-formed (sharded/regroup.py)
    return {"accumulator": acc.state_dict(), "optimizers": [None if getattr(o, "sharded", False) else o.state_dict()
                                                            for o in acc.wrapped_optimizers],
            "schedulers": [s.state_dict() for s in acc.wrapped_schedulers],
            "registered": {name: obj.state_dict() for name, obj in m.registered.items()},
            "counters": reducer.attached.progress(), "layout": reducer.attached.layout_state(),
            "hook": saved_state(reducer.launcher.state) if reducer.launcher.hook is not None else None,
            "events": list(m.events), "joins_seen": m.joins_seen}


def load_state(m: Any, acc: Any, reducer: Any, state: dict[str, Any]) -> None:
    acc.load_state_dict(state["accumulator"])
    for mine, theirs in ((acc.wrapped_optimizers, state["optimizers"]), (acc.wrapped_schedulers, state["schedulers"])):
        if len(mine) != len(theirs):
            raise MembershipError(f"gradsync: this replica wrapped {len(mine)} optimizers/schedulers where the "
                                  f"members wrapped {len(theirs)}; every replica runs the same script")
        for obj, sd in zip(mine, theirs):
            if sd is not None:
                obj.load_state_dict(sd)
    for name, sd in state["registered"].items():
        if name not in m.registered:
            raise MembershipError(f"gradsync: the members registered {name!r} (gradsync.elastic.register) but this "
                                  "replica did not, before its first window")
        m.registered[name].load_state_dict(sd)
    # a comm hook's state that can be saved (torch's PowerSGD: its step count, warm starts, random state), but not
    # the error feedback, each rank's own residual: a replica that contributed nothing owes none
    for name, value in (state["hook"] or {}).items() if reducer.launcher.state is not None else ():
        if name != "error_dict":
            setattr(reducer.launcher.state, name, value)
    reducer.attached.load_progress(state["counters"])
    reducer.attached.load_layout(state["layout"])
    m.events, m.joins_seen = list(state["events"]), state["joins_seen"]


def transfer(m: Any, acc: Any, reducer: Any, source: int) -> int:
    """Send (from ``source``) or receive the state; return the bytes each receiver got."""
    src = m.members.index(source)
    wait = lambda work: reducer.wait(work, "the state sent to a joining replica")  # noqa: E731
    blob = broadcast_bytes(serialized(state_of(m, acc, reducer)) if m.replica_id == source else None, src,
                           dist.group.WORLD, wait)
    tensors = list(acc.model.parameters()) + list(acc.model.buffers())
    # through a copy: a member frozen in this broadcast, left out and continued, can complete it late (gloo cannot
    # cancel it) and would write into the parameters of whoever received it
    broadcast_coalesced([t.data for t in tensors], dist.group.WORLD, wait, src, in_place=False)
    if m.replica_id != source:
        load_state(m, acc, reducer, deserialized(blob))
    return blob.numel() + sum(t.numel() * t.element_size() for t in tensors)


def record(m: Any, g: int, window: int, joined: list[int], start: float, sent: int) -> None:
    event = MembershipEvent(generation=g, window=window, left=[], joined=joined, micro_steps_lost=0,
                            seconds=m.slowest(time.monotonic() - start))
    m.events.append(event)
    m.bytes_per_join.append(sent)
    log.warning("gradsync.elastic: generation %d: replica(s) %s joined before window %d; members %s; "
                "%.2f s, %d bytes sent", g, joined, window, m.members, event.seconds, sent)


__all__ = ["REQUESTS_S", "Requests", "at_boundary", "admit", "join", "load_state", "standing", "state_of", "transfer"]
