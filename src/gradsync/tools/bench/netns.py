"""An emulated network link for benchmarks: two network namespaces joined by a veth pair (``link``), or
several on one bridge (``star``), each end's NIC limited by ``tc``.

    from gradsync.tools.bench.netns import available, link
    if available():
        with link("gs-clu", "10.78.0", rate="2gbit") as net:
            subprocess.Popen(net.exec(0, [sys.executable, "worker.py"]), env={**os.environ, **net.env(0)})

Each end gets an address only inside its namespace (the host's routes are untouched), optionally a
``tc`` token bucket (``tbf``) limiting its egress to ``rate``. On exit, on an exception and on
SIGTERM/SIGINT, every process left in the namespaces is killed and the namespaces are deleted (each
takes its veth end along). Needs root, ``ip`` and, for a rate, ``tc``.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from ..._torch import default_store

__all__ = ["Link", "available", "enter", "link", "kill_namespace", "delete", "existing", "regroup_in", "star"]


@dataclass(frozen=True)
class Link:
    """The ends: namespace names, veth device names, and addresses (``link``: ``10.x.y.1`` and ``.2``)."""
    namespaces: tuple[str, ...]
    devices: tuple[str, ...]
    addresses: tuple[str, ...]
    rate: str | None

    def exec(self, end: int, cmd: list[str]) -> list[str]:
        """``cmd`` run inside namespace ``end`` (0, 1, ...)."""
        return ["ip", "netns", "exec", self.namespaces[end], *cmd]

    def env(self, end: int) -> dict[str, str]:
        """Environment for a gloo process at ``end``: it binds to that end's veth."""
        return {"GLOO_SOCKET_IFNAME": self.devices[end]}

    def kill(self, end: int) -> list[int]:
        """SIGKILL every process in namespace ``end`` (a machine dying); return their pids."""
        return kill_namespace(self.namespaces[end])


def available(rate: bool = True) -> bool:
    """Root, a working ``ip netns`` and (with ``rate``) ``tc``: the link can be made here."""
    if os.geteuid() != 0:
        return False
    try:
        ok = subprocess.run(["ip", "netns", "list"], capture_output=True).returncode == 0
        return ok and (not rate or subprocess.run(["tc", "-V"], capture_output=True).returncode == 0)
    except OSError:
        return False


def kill_namespace(ns: str) -> list[int]:
    """SIGKILL every process in namespace ``ns``; return their pids."""
    pids = [int(p) for p in subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                            text=True).stdout.split()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def delete(namespaces: tuple[str, ...]) -> None:
    """Kill what runs in each namespace and delete it (a missing one is fine)."""
    for ns in namespaces:
        kill_namespace(ns)
        subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL)


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


@contextlib.contextmanager
def _ended_by_signals() -> Iterator[None]:
    """SIGTERM or SIGINT inside the block ends it as KeyboardInterrupt, so that its clean-up runs."""
    def stop(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _tbf(rate: str | None, burst: str, latency: str) -> list[str] | None:
    """The ``tc qdisc add ... root`` arguments that limit an interface's egress to ``rate`` (None: unlimited)."""
    return ["tbf", "rate", rate, "burst", burst, "latency", latency] if rate else None


def _place(ns: str, dev: str, addr: str, shape: list[str] | None) -> None:
    """Move veth end ``dev`` into namespace ``ns`` with ``addr``/24, up (and ``lo``), its egress shaped by ``shape``."""
    _run("ip", "link", "set", dev, "netns", ns)
    _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
    _run("ip", "-n", ns, "link", "set", dev, "up")
    _run("ip", "-n", ns, "link", "set", "lo", "up")
    if shape:
        _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *shape)


@contextlib.contextmanager
def link(prefix: str, subnet: str, rate: str | None = None, tag: str | None = None,
         burst: str = "256kb", latency: str = "10ms") -> Iterator[Link]:
    """Two namespaces ``<prefix>-a<tag>``/``-b<tag>`` joined by veths ``<prefix>-va<tag>``/``-vb<tag>``,
    addressed ``<subnet>.1`` and ``<subnet>.2`` (/24) inside them, ``tc tbf rate`` on each end when given.

    ``tag`` (default: this process id) keeps concurrent runs apart. Removed on exit, on an error and
    when SIGTERM or SIGINT arrives while inside (the signal then ends the block as KeyboardInterrupt).
    """
    tag = str(os.getpid()) if tag is None else tag
    net = Link(namespaces=(f"{prefix}-a{tag}", f"{prefix}-b{tag}"),
               devices=(f"{prefix}-va{tag}"[:15], f"{prefix}-vb{tag}"[:15]),  # interface names: 15 chars at most
               addresses=(f"{subnet}.1", f"{subnet}.2"), rate=rate)
    shape = _tbf(rate, burst, latency)
    with _ended_by_signals():
        try:
            delete(net.namespaces)  # a run killed with SIGKILL may have left them
            for ns in net.namespaces:
                _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", net.devices[0], "type", "veth", "peer", "name", net.devices[1])
            for ns, dev, addr in zip(net.namespaces, net.devices, net.addresses):
                _place(ns, dev, addr, shape)
            yield net
        finally:
            delete(net.namespaces)


@contextlib.contextmanager
def star(prefix: str, subnet: str, ends: int, rate: str | None = None, tag: str | None = None,
         burst: str = "256kb", latency: str = "10ms") -> Iterator[Link]:
    """``ends`` namespaces ``<prefix>-<i><tag>``, each with a veth to one bridge in this namespace (which has no
    address): ``<subnet>.<i + 1>`` inside namespace i, ``tc tbf rate`` both ways on each end's veth (its NIC's send
    and receive). Removed on exit, on an error and on SIGTERM/SIGINT, as ``link``."""
    tag = str(os.getpid()) if tag is None else tag
    net = Link(namespaces=tuple(f"{prefix}-{i}{tag}" for i in range(ends)),
               devices=tuple(f"{prefix}{i}i{tag}"[:15] for i in range(ends)),  # interface names: 15 chars at most
               addresses=tuple(f"{subnet}.{i + 1}" for i in range(ends)), rate=rate)
    bridge, ports = f"{prefix}br{tag}"[:15], [f"{prefix}{i}o{tag}"[:15] for i in range(ends)]
    shape = _tbf(rate, burst, latency)
    with _ended_by_signals():
        try:
            delete(net.namespaces)
            subprocess.run(["ip", "link", "del", bridge], stderr=subprocess.DEVNULL)
            _run("ip", "link", "add", bridge, "type", "bridge")
            _run("ip", "link", "set", bridge, "up")
            for ns, dev, addr, port in zip(net.namespaces, net.devices, net.addresses, ports):
                _run("ip", "netns", "add", ns)
                _run("ip", "link", "add", dev, "type", "veth", "peer", "name", port)
                _run("ip", "link", "set", port, "master", bridge)
                _run("ip", "link", "set", port, "up")
                if shape:  # the bridge port's egress: what this end's NIC receives
                    _run("tc", "qdisc", "add", "dev", port, "root", *shape)
                _place(ns, dev, addr, shape)
            yield net
        finally:
            delete(net.namespaces)  # each takes its veth, and so its bridge port, along
            subprocess.run(["ip", "link", "del", bridge], stderr=subprocess.DEVNULL)


def enter(namespace: str) -> None:
    """Move the calling thread (in a freshly forked rank: the process; threads it starts later follow) into
    ``namespace`` (``setns``)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {namespace}: {os.strerror(err)}")
    finally:
        os.close(fd)


def regroup_in(namespace: str, device: str, rank: int, world: int) -> None:
    """In a rank of ``run_ranks``: move into ``namespace`` and replace the default (loopback) process group by
    one over ``device`` there, rendezvousing on the old group's store (prefixed)."""
    store = default_store()
    enter(namespace)
    os.environ["GLOO_SOCKET_IFNAME"] = device
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.PrefixStore("link", store), rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    dist.barrier()


def existing() -> list[str]:
    """The namespaces on this machine now (for checks that a run left none behind)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]
