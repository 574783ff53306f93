"""Where elastic membership attaches: the wrapper, the accumulator, and the window boundary.

A model built on the default process group after ``init_process_group`` attaches the membership to its
reducer as its commit protocol (``engine/protocol.py``): the reducer writes a reduction back only once
every member voted that it holds it, and re-forms with the survivors otherwise. An accumulator names
the window a membership event happened in; between windows it admits replicas waiting to join
(``join.py``). The engine and the accumulator know none of this: they announce themselves
(``process.announce``) and this module listens.
"""
from __future__ import annotations

import weakref
from typing import Any

import logging
import os
import signal
import sys
import threading
import warnings
from datetime import timedelta

import torch.distributed as dist

from .. import process
from ..engine.protocol import attach
from .identity import Liveness, connect, identify
from .join import Requests, at_boundary, standing
from .membership import StoreMembership, log


def init_process_group(backend: str = "gloo", *, timeout: timedelta | float = 60.0) -> None:
    """Join the elastic job at ``GRADSYNC_COORDINATOR`` and make its group torch's default process group.

    The replicas are started by ``gradsync run``, or by any launcher (``torchrun``, ``srun``, a
    Kubernetes pod) with ``GRADSYNC_COORDINATOR`` pointing at a ``gradsync coordinator``. Returns once
    every replica of the job has arrived (generation 0), or at once for a replica that arrives later
    (it joins at a window boundary). A gradsync model built afterwards without ``process_group=``
    follows every membership change. ``timeout`` bounds every wait (seconds or a timedelta)."""
    if process.state.replica is not None:
        raise RuntimeError("gradsync: gradsync.elastic.init_process_group() was already called in this process")
    env = os.environ
    if "GRADSYNC_COORDINATOR" not in env:
        raise RuntimeError("gradsync: gradsync.elastic.init_process_group() needs the replicas started by "
                           "`gradsync run --replicas N script.py`, or GRADSYNC_COORDINATOR=HOST:PORT of a "
                           "`gradsync coordinator` (e.g. under torchrun); GRADSYNC_COORDINATOR is not set")
    if dist.is_initialized():
        raise RuntimeError("gradsync: torch.distributed is already initialized; with gradsync.elastic the "
                           "script makes no init_process_group() call of its own")
    timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
    address = env["GRADSYNC_COORDINATOR"]
    store = connect(address, timeout)
    me = identify(store, env, address, timeout)
    liveness = Liveness(address, me, store, reports=me.machine < 0)  # no launcher: it beats and reports itself
    m = StoreMembership(store, backend=backend, replica_id=me.replica_id, restart=me.restart, replicas=me.replicas,
                        min_replicas=me.min_replicas, timeout=timeout, machine=me.machine)
    m.liveness, liveness.graveyard = liveness, m.graveyard
    m.form_first()
    m.requests = Requests(m, address)
    install(m)
    if threading.current_thread() is not threading.main_thread():  # Python runs signal handlers there only
        warnings.warn("gradsync: gradsync.elastic.init_process_group() ran outside the main thread, so it installs no "
                      "signal handlers: SIGUSR1 (SLURM's warning before the time limit) kills this replica instead of "
                      "stopping every replica at the same window end, and a SIGTERM is not reported to the others "
                      "(they find the replica gone after its heartbeat stops, ~5 s). Call it from the main thread.",
                      stacklevel=2)
    elif not callable(signal.getsignal(signal.SIGUSR1)):
        # SLURM's warning before the time limit: finish the window, stop together (gradsync.elastic.stopping)
        signal.signal(signal.SIGUSR1, lambda signum, frame: setattr(m, "stop_requested", True))
    if not log.handlers and not logging.getLogger().handlers:  # one line per change, on stderr
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)


def install(replica: Any) -> None:
    """Models built on the default process group from now on follow ``replica``'s generations."""
    process.state.replica = replica
    process.listen("wrapper", on_wrapper)
    process.listen("accumulator", on_accumulator)
    process.listen("window", on_window)


def on_wrapper(ddp: Any, default_group: bool) -> None:
    """Make ``ddp`` (a gradsync wrapper) follow the replica's generations if it is on the default group."""
    replica = process.state.replica
    if replica is None or not default_group:
        return
    if ddp.reducer.store.sharded:  # a member that leaves must not take its shard with it (sharded/regroup.py)
        ddp.reducer.store.mirror_shards()
    wrapper = weakref.ref(ddp)

    def follow_group(group: Any) -> None:
        if wrapper() is not None:
            wrapper().follow_group(group)
    attach(ddp.reducer, replica, follow_group)
    ddp.reducer.plane.standing = lambda: standing(replica)  # join requests and a stop, in every synced backward


def followed(model: Any) -> bool:
    """Whether ``model``'s reducer has the replica's membership attached."""
    attached = getattr(getattr(model, "reducer", None), "attached", None)
    return attached is not None and attached.protocol is process.state.replica


def on_accumulator(acc: Any) -> None:
    if process.state.replica is None or not followed(acc.model):
        return
    process.state.replica.window_source = weakref.WeakMethod(acc.window_position)  # names events' windows


def on_window(acc: Any) -> None:
    """Between windows: admit replicas waiting to join, or join if this replica arrived late."""
    if process.state.replica is not None and followed(acc.model):
        at_boundary(acc)


__all__ = ["init_process_group", "install", "on_accumulator", "on_window", "on_wrapper"]
