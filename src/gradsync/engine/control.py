"""The control plane: phase headers, the end-of-backward control, carried values, and bounded waits.

Gradient buckets are the data plane (``launcher.py``). What the ranks must agree on travels here.

**Phase headers.** gloo pairs the k-th collective of one rank with the k-th of every other, and two
collectives of different kinds (a buffer broadcast and a bucket all-reduce) never complete: both ranks
would wait for the group's timeout, 30 minutes by default. So each phase (a training forward's buffer
broadcast, a synced backward) first all-reduces a header of the same shape on every rank: one row per
rank, ``[kind, forward count, backward count, comm hook id, payload...]``, each rank writing only its own row.
Whatever phase each rank is in, the headers pair, every rank learns what the others do, and all raise the same
diagnosis before issuing anything that could not pair (a bucket through a hook other ranks lack). A slow rank is
not an error. A synced backward's payload carries ``PAYLOAD`` float64 values per rank at no extra collective, as
int64 bits (exactly): the first ``CARRIED`` once (``carry``: the accumulator's item count), the rest every time
(``standing``: elastic membership's join requests and stop).

**The control.** Each synced backward ends with one small int32 all-reduce, launched right after the last bucket
so that its latency hides behind theirs: ``[backward count per rank | used count per parameter | forward count
per rank | failed flag per rank | compute us + 1, wait us, local squared norm per rank | present]``. Each rank
writes only its own slots, so the sum is an all-gather of the counters (``Verdict`` reads it). The times need every
bucket's result, which comes after the launch: they ride in the next synced backward's control (``send_control``).

**Waits.** Every wait on any collective goes through ``ControlPlane.wait``, bounded by the timeout. When the
data plane is on a device, the control traffic runs on a CPU (gloo) group of the same ranks (``control_group``):
no header, control or carried value is read back from the device, and waits on the data plane's collectives
are stream waits (their futures), not host waits.
"""
from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .. import process
from .._torch import Future
from .errors import PeerFailure, SyncError
from .groups import control_group
from .messages import foreign_header, hooks_differ, out_of_step, phase_mismatch, phases_out_of_step, wait_failed

FORWARD, BACKWARD, AUDIT = 1, 2, 3  # a joined rank shadowing the others writes a row of zeros; AUDIT: audit.py
PAYLOAD, CARRIED = 6, 4  # float64 slots per rank in a header; the first CARRIED for carry(), the rest standing


def bounded_wait(handle: Any, timeout: timedelta) -> None:
    """Wait for a ``dist.Work`` or a future; raise its error, or TimeoutError after ``timeout``."""
    process.state.last_wait = handle  # gloo's thread must never drop its last reference (process.State)
    if not process.state.exit_hook:
        process.install_exit_hook()
    if not isinstance(handle, Future):
        handle.wait(timeout)
        return
    if not handle.done():
        released = threading.Event()
        signal = lambda _fut: None  # noqa: E731
        # wake once gloo's thread has run the callback *and dropped it*, which takes the GIL
        weakref.finalize(signal, released.set)
        handle.add_done_callback(signal)
        del signal
        if not released.wait(timeout.total_seconds()):
            raise TimeoutError("operation timed out")
    handle.wait()  # re-raises an error the future holds


def header_tensor(rank: int, world_size: int, kind: int, forward_count: int, backward_count: int,
                  device: torch.device | None = None, payload: Sequence[float] = (), hook: int = 0) -> torch.Tensor:
    """This rank's header; ``kind=0``: a rank that takes part without a phase of its own; ``hook``: ``hook_id``'s."""
    if len(payload) > PAYLOAD:
        raise ValueError(f"gradsync: a phase header carries at most {PAYLOAD} values, got {len(payload)}")
    header = torch.zeros(world_size, 4 + PAYLOAD, dtype=torch.int64)
    if kind:
        bits = torch.tensor(list(payload) + [0.0] * (PAYLOAD - len(payload)), dtype=torch.float64).view(torch.int64)
        header[rank] = torch.cat([torch.tensor([kind, forward_count, backward_count, hook]), bits])
    return header.to(device) if device is not None else header


def empty_control(world_size: int, n: int, device: torch.device | None = None, extra: int = 0) -> torch.Tensor:
    """A zero control: the contribution of a rank that takes no part (e.g. a joined one); ``extra``: int32
    slots per rank after the telemetry (``replicas.py``'s fingerprints)."""
    return torch.zeros((6 + extra) * world_size + n + 1, dtype=torch.int32, device=device)


def control_tensor(rank: int, world_size: int, backward_count: int, forward_count: int,
                   used: Sequence[bool], device: torch.device | None = None, failed: int = 0,
                   times_us: Sequence[float] | None = None, norm2: torch.Tensor | None = None,
                   extra: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's control. ``failed``: 1 when its backward failed part-way and its window can be reduced again
    without it, 2 when it cannot (it held synced gradients of the window already). ``times_us``: its previous synced
    backward's compute and wait (None: none to send); ``norm2``: its local gradient's squared norm, a float32 whose
    bits ride in an int32 slot (the sum adds zeros); ``extra``: its own int32 slots after the telemetry."""
    w, n = world_size, len(used)
    e = 0 if extra is None else extra.numel()
    control = empty_control(w, n, extra=e)
    control[rank] = backward_count
    control[w:w + n] = torch.tensor(used, dtype=torch.int32)
    control[w + n + rank] = forward_count
    control[2 * w + n + rank] = failed
    if times_us is not None:  # the compute slot is 1 more: 0 means the rank sent none
        control[3 * w + n + rank] = min(int(times_us[0]) + 1, 2**31 - 1)
        control[4 * w + n + rank] = min(int(times_us[1]), 2**31 - 1)
    control[-1] = 1
    control = control.to(device) if device is not None else control
    if norm2 is not None:
        control[5 * w + n + rank] = norm2.reshape(1).to(device=control.device, dtype=torch.float32).view(torch.int32)[0]
    if extra is not None:
        control[6 * w + n + rank * e:6 * w + n + (rank + 1) * e] = extra.to(control.device)
    return control


@dataclass
class Counters:
    """Per-rank counters every rank compares (headers, control): the reducer advances them."""

    forward: int = 0  # training forwards with grad enabled: catches skipped backwards
    backward: int = 0  # every prepared backward, synced or not
    sync: int = 0  # synced backwards finished
    pending: int = 0  # forwards not yet followed by a backward (not compared)
    armed: bool = False  # the latest forward wanted its backward to synchronize
    forward_end: float = 0.0  # when the latest forward ended: a synced backward's own work is timed from it

    def note_forward(self, training: bool, sync: bool) -> None:
        """A forward that a backward may follow; only training forwards count for the skipped-backward check."""
        self.pending, self.forward_end, self.armed = self.pending + 1, time.perf_counter(), bool(sync)
        self.forward += training

    def take_backward(self) -> bool:
        """A backward starts: whether a forward prepared it (it counts then)."""
        if self.pending == 0:
            return False
        self.pending, self.backward = self.pending - 1, self.backward + 1
        return True


class ControlPlane:
    headers = True  # False only to measure what the headers cost (benchmarks)
    failure = property(lambda self: SyncError if self.protocol is None else PeerFailure)  # a protocol re-forms on it

    def __init__(self, group: dist.ProcessGroup, *, rank: int, world_size: int, device: torch.device,
                 timeout: timedelta, counters: Counters, data_device: torch.device | None = None):
        self.group, self.rank, self.world_size = group, rank, world_size
        self.device = device  # of the control tensors (``control_group``)
        # off CPU a Work's bounded wait(timeout) blocks the host until the device finished it; its
        # future orders the current stream after the collective instead (NCCL's watchdog bounds it)
        self.stream_waits = data_device is not None and data_device.type != "cpu"
        self.data_device = data_device or device
        self.timeout = timeout
        self.counters = counters
        self.header: torch.Tensor | None = None  # the pending or latest header
        self.kind = 0  # the pending header's phase
        self.work: Any = None  # the pending header's collective
        self.payload: tuple[float, ...] = ()  # to send in the next header
        self.payloads: dict[int, tuple[float, ...]] | None = None  # the active ranks', from the latest header
        self.active_ranks: list[int] | None = None  # inside DDP.join(): this forward's active ranks
        self.headers_sent = 0  # phases this rank started (a skipped micro-step replays the missing ones)
        self.sent_payload: tuple[float, ...] = ()  # carried by the latest synced backward's header
        self.standing: Callable[[], tuple[float, ...]] | None = None  # the slots after CARRIED, in every one
        self.protocol: Any = None  # a commit protocol (protocol.py): waits also end when the group broke
        self.times: tuple[int, float, float] | None = None  # (sync, compute us, wait us) for the next control
        self.replicas: Any = None  # check_replicas=True: replicas.ReplicaCheck, its fingerprints ride in the control
        self.hook: tuple[int, str] = (0, "none")  # the comm hook's id and name, compared in every header

    def regroup(self, group: dist.ProcessGroup, rank: int, world_size: int) -> None:
        """Use (the control group for) a new data group; the next header carries the same values."""
        self.group, self.device = control_group(group, self.data_device)
        self.rank, self.world_size = rank, world_size
        self.work, self.payload, self.payloads, self.times = None, self.sent_payload, None, None
        if self.replicas is not None:
            self.replicas.forget()

    def set_active(self, ranks: list[int] | None) -> None:
        """Inside ``DDP.join()``: the ranks with data for this forward (None: every rank)."""
        self.active_ranks = ranks

    def active(self) -> list[int]:
        """The ranks taking part in this phase with gradients of their own (all, outside a join)."""
        return list(self.active_ranks) if self.active_ranks is not None else list(range(self.world_size))

    # ---------------------------------------------------------------- headers
    def carry(self, values: Sequence[float]) -> Callable[[], dict[int, tuple[float, ...]] | None]:
        """Send ``values`` (at most ``CARRIED``) in the next synced backward's header; return a reader of
        the active ranks' values, by rank (None until that header completed, or if none ran)."""
        if len(values) > CARRIED:
            raise ValueError(f"gradsync: a phase header carries at most {CARRIED} values, got {len(values)}")
        self.payload = tuple(float(v) for v in values)
        return lambda: self.payloads

    def launch_header(self, kind: int) -> None:
        """Start this phase's header all-reduce; ``kind=0`` shadows as a joined rank."""
        payload = ()
        if kind == BACKWARD:  # carried values go with a synced backward, never a forward's broadcast
            payload, self.payload, self.payloads = self.payload, (), None
            self.sent_payload = payload
            if self.standing is not None:
                payload = payload + (0.0,) * (CARRIED - len(payload)) + self.standing()
        self.kind = kind
        self.headers_sent += 1
        if self.world_size == 1 and kind == BACKWARD and self.active_ranks is None:
            self.payloads = {0: payload} if payload else None  # a group that shrank to one member
        if self.world_size > 1 and self.headers:
            c = self.counters
            self.header = header_tensor(self.rank, self.world_size, kind, c.forward, c.backward, self.device,
                                        payload, self.hook[0])
            self.work = dist.all_reduce(self.header, group=self.group, async_op=True)

    def check_header(self) -> None:
        """Wait for the pending header; raise on every rank unless all are in the same phase."""
        work, self.work = self.work, None
        if work is None:
            return
        self.wait(work, "the phase header")  # a slow rank is fine: this waits the usual bound
        rows = self.header.cpu().tolist()
        check_phases([tuple(r[:3]) for r in rows], rank=self.rank, active=self.active())
        if len({rows[r][3] for r in self.active()}) > 1:  # before a bucket: a hook's wire would not pair
            raise SyncError(hooks_differ({r: rows[r][3] for r in self.active()}, self.rank, self.hook[1]))
        if self.kind in (BACKWARD, 0):  # 0: a joined rank reads what the active ranks carried (shadow.py)
            values = self.header[:, 4:].cpu().contiguous().view(torch.float64).tolist()
            self.payloads = {r: tuple(values[r]) for r in self.active()}

    def exchange_header(self, kind: int) -> None:
        """Run a header to completion before a phase whose first collective must pair (a broadcast)."""
        self.launch_header(kind)
        self.check_header()

    def drop_header(self) -> None:
        """The backward raised: its header is not waited for."""
        self.work = None

    # ---------------------------------------------------------------- control and waits
    def launch_control(self, control: torch.Tensor) -> dist.Work:
        """All-reduce the end-of-backward control (after the buckets' collectives)."""
        return dist.all_reduce(control, group=self.group, async_op=True)

    def send_control(self, used: Sequence[bool], failed: int, norm2: torch.Tensor | None) -> tuple[Any, torch.Tensor]:
        """Launch this rank's control after its buckets, before their results, with the last synced backward's times."""
        c, times, check = self.counters, self.times, self.replicas
        sent = control_tensor(self.rank, self.world_size, c.backward, c.forward, used, self.device, failed,
                              times[1:] if times is not None and times[0] == c.sync - 1 else None, norm2,
                              check.outgoing(self.device) if check is not None else None)
        return self.launch_control(sent), sent

    def read_control(self, launched: tuple[Any, torch.Tensor], n: int, times_us: tuple[float, float],
                     results: Sequence[torch.Tensor] | None = None) -> Verdict:
        """Keep this synced backward's ``times_us`` (and ``results``' fingerprints) for the next control;
        wait for this one, read it and check it."""
        self.times = (self.counters.sync, *times_us)
        if self.replicas is not None:
            self.replicas.reduced(results)
        work, sent = launched
        self.wait(work, "the end-of-backward check")
        verdict = Verdict(sent.cpu(), self.rank, self.world_size, n, self.active(), self.counters.sync, self.extra_slots())
        if self.replicas is not None:
            self.replicas.check(verdict.extra(), verdict.active, self.counters.sync, self)
        return verdict

    def extra_slots(self) -> int:  # int32 slots per rank in the control after the telemetry (replicas.py)
        return self.replicas.slots() if self.replicas is not None else 0

    def wait(self, handle: Any, what: str) -> None:
        """Wait for a Work or Future, bounded by the timeout, with a useful error."""
        if self.stream_waits and not isinstance(handle, Future):
            try:
                handle = handle.get_future()
            except RuntimeError:  # gloo's reduce-scatter has none: its wait is the only one
                pass
        try:
            if self.protocol is not None:
                self.protocol.wait(handle, self.timeout)
            else:
                bounded_wait(handle, self.timeout)
        except Exception as exc:
            raise self.failure(wait_failed(self.rank, what, self.counters.sync, self.counters.backward,
                                           self.timeout.total_seconds(), exc)) from exc


class Verdict:
    """What the reduced control says; raises on every rank if the ranks were out of step."""

    def __init__(self, control: torch.Tensor, rank: int, world_size: int, n: int, active: Sequence[int], sync: int,
                 extra: int = 0):
        w = world_size
        self.control, self.world_size, self.n, self.active, self.e = control, w, n, list(active), extra
        backward, forward = control[:w].tolist(), control[w + n:2 * w + n].tolist()
        idle = [r for r in range(w) if r not in active]
        if (int(control[-1]) != len(active) or any(backward[r] <= 0 for r in active)
                or any(backward[r] or forward[r] for r in idle)):
            raise SyncError(out_of_step(rank, sync))
        if len({backward[r] for r in active}) > 1 or len({forward[r] for r in active}) > 1:
            raise SyncError(phase_mismatch(", ".join(f"rank {r}: forward {forward[r]}, backward {backward[r]}" for r in active)))
        self.counts: list[int] = control[w:w + n].tolist()  # per parameter: the ranks that produced a gradient
        flags = control[2 * w + n:3 * w + n].tolist()
        self.failed = {r: flag for r, flag in enumerate(flags) if flag}  # ranks whose backward failed part-way

    def telemetry(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per rank [compute us + 1 (0: none sent) | wait us] of the previous synced backward, and this
        one's local squared norms (float32)."""
        w, n = self.world_size, self.n
        return self.control[3 * w + n:5 * w + n], self.control[5 * w + n:6 * w + n].contiguous().view(torch.float32)

    def extra(self) -> torch.Tensor:  # each rank's extra slots (empty_control), one row per rank
        w, n = self.world_size, self.n
        return self.control[6 * w + n:6 * w + n + self.e * w].view(w, self.e)

    def check_missing(self, names: Sequence[str], params: Sequence[torch.Tensor]) -> None:
        """Raise if a rank produced no gradient for a parameter (no find_unused_parameters), unless frozen everywhere."""
        absent = [names[i] for i, c in enumerate(self.counts) if c < len(self.active) and (c or params[i].requires_grad)]
        if absent:
            shown = ", ".join(absent[:20]) + (f" and {len(absent) - 20} more" if len(absent) > 20 else "")
            raise RuntimeError(
                f"gradsync: {len(absent)} parameter(s) received no gradient in this backward on at least one "
                f"rank: {shown}. If some parameters are not used in every iteration, construct "
                "DistributedDataParallel with find_unused_parameters=True. The gradients were not "
                "synchronized; do not step the optimizer on them.")


def check_phases(rows: list[tuple[int, int, int]], *, rank: int, active: Sequence[int]) -> None:
    """Raise on every rank unless the active ranks are in the same phase and no other rank is."""
    idle = [r for r in range(len(rows)) if r not in active]
    if any(any(rows[r]) for r in idle) or any(rows[r][0] not in (FORWARD, BACKWARD, AUDIT) for r in active):
        raise SyncError(foreign_header(rows, rank=rank, active=active))
    if len({rows[r] for r in active}) != 1:
        raise SyncError(phases_out_of_step([(r, rows[r][0], rows[r][1], rows[r][2]) for r in active]))


__all__ = ["AUDIT", "BACKWARD", "CARRIED", "FORWARD", "PAYLOAD", "ControlPlane", "Counters", "Verdict", "bounded_wait",
           "control_tensor", "empty_control", "header_tensor"]
