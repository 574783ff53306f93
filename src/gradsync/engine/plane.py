"""The control plane: phase headers, the end-of-backward control, carried values, and bounded waits.

Gradient buckets are the data plane (``launcher.py``). What the ranks must agree on travels
here: each synced backward (and each forward that broadcasts buffers) starts with a phase header
(``header.py``), which also carries one float per rank for the layers (the accumulator's item
count: ``carry``); each synced backward ends with the control all-reduce (``control.py``). Every
wait on any collective goes through ``wait``, bounded by the configured timeout. The plane has its
own group handle: when the data plane is on a device, the control traffic runs on a CPU (gloo) group
of the same ranks (``control_group``), so no header, control or carried value is ever read back from
the device: a steady-state step makes no device-to-host sync, and the CPU runs ahead as it does under
torch's DDP. Waits on the data plane's collectives are then stream waits (their futures), not host waits.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .._torch import is_future, is_registered
from .control import SyncError, bounded_wait
from .header import BACKWARD, check_header, header_tensor, payloads
from .protocol import PeerFailure

# tests only: give a CPU data plane its own control group too, as a device data plane has
SEPARATE_ON_CPU = False


def reduces_cpu(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` can all-reduce CPU tensors (gloo, or a group with a CPU backend beside NCCL)."""
    try:
        group._get_backend(torch.device("cpu"))
    except (RuntimeError, AttributeError, ValueError):
        return False
    return True


def control_group(group: dist.ProcessGroup, data_device: torch.device) -> tuple[dist.ProcessGroup, torch.device]:
    """Return the group and device of the control plane for a data plane on ``data_device``.

    A CPU data plane shares its group. Off CPU the control tensors stay on the CPU: over ``group``
    when it has a CPU backend, otherwise over a new gloo group of the same ranks (its members alone
    take part in making it: ``use_local_synchronization``). Only without gloo do they go on the
    device, and each synced backward then reads them back (two syncs)."""
    cpu = torch.device("cpu")
    if data_device.type == "cpu" and not SEPARATE_ON_CPU:
        return group, cpu
    if data_device.type != "cpu" and reduces_cpu(group):
        return group, cpu
    if not dist.is_gloo_available():
        return group, data_device
    return _gloo_group(dist.get_process_group_ranks(group)), cpu


_subgroups: dict[tuple[int, ...], dist.ProcessGroup] = {}


def _gloo_group(ranks: list[int]) -> dist.ProcessGroup:
    if len(ranks) == dist.get_world_size():  # every rank builds this wrapper: a new group, named by count
        return dist.new_group(ranks=ranks, backend="gloo")
    # only the members build it (use_local_synchronization), and torch names such a group by its
    # ranks, once: the wrappers over one subgroup share its control group
    known = _subgroups.get(tuple(ranks))
    if known is None or not is_registered(known):
        known = _subgroups[tuple(ranks)] = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
    return known


@dataclass
class Counters:
    """Per-rank counters every rank compares (headers, control): the reducer advances them."""

    forward: int = 0  # training forwards with grad enabled: catches skipped backwards
    backward: int = 0  # every prepared backward, synced or not
    sync: int = 0  # synced backwards finished


class ControlPlane:
    headers = True  # False only to measure what the headers cost (benchmarks/header_cost.py)

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
        self._header: torch.Tensor | None = None
        self._kind = 0  # the pending header's phase
        self._work: Any = None
        self._payload: tuple[float, ...] = ()  # to send in the next header
        self._payloads: dict[int, tuple[float, ...]] | None = None  # the active ranks', from the latest header
        self.active_ranks: list[int] | None = None  # inside DDP.join(): this forward's active ranks
        self.headers_sent = 0  # phases this rank started (a skipped micro-step replays the missing ones)
        self.sent_payload: tuple[float, ...] = ()  # carried by the latest synced backward's header
        self.membership: Any = None  # engine/protocol.py: waits also end when the group is known broken

    def regroup(self, group: dist.ProcessGroup, rank: int, world_size: int) -> None:
        """Use (the control group for) a new data group: elastic membership re-formed it; the next
        header carries the same values."""
        self.group, self.device = control_group(group, self.data_device)
        self.rank, self.world_size = rank, world_size
        self._work, self._payload, self._payloads = None, self.sent_payload, None

    def set_active(self, ranks: list[int] | None) -> None:
        """Inside ``DDP.join()``: the ranks with data for this forward (None: every rank)."""
        self.active_ranks = ranks

    def active(self) -> list[int]:
        """The ranks taking part in this phase with gradients of their own (all, outside a join)."""
        return list(self.active_ranks) if self.active_ranks is not None else list(range(self.world_size))

    # ---------------------------------------------------------------- headers
    def carry(self, values: Sequence[float]) -> Callable[[], dict[int, tuple[float, ...]] | None]:
        """Send ``values`` (at most ``header.PAYLOAD``) in the next synced backward's header; return a
        reader of the active ranks' values, by rank (None until that header completed, or if none ran)."""
        self._payload = tuple(float(v) for v in values)
        return lambda: self._payloads

    def launch_header(self, kind: int) -> None:
        """Start this phase's header all-reduce; ``kind=0`` shadows as a joined rank."""
        payload = ()
        if kind == BACKWARD:  # carried values go with a synced backward, never a forward's broadcast
            payload, self._payload, self._payloads = self._payload, (), None
            self.sent_payload = payload
        self._kind = kind
        self.headers_sent += 1
        if self.world_size == 1 and kind == BACKWARD and self.active_ranks is None:
            self._payloads = {0: payload} if payload else None  # a group that shrank to one member
        if self.world_size > 1 and self.headers:
            c = self.counters
            self._header = header_tensor(self.rank, self.world_size, kind, c.forward, c.backward, self.device,
                                         payload)
            self._work = dist.all_reduce(self._header, group=self.group, async_op=True)

    @property
    def header_pending(self) -> bool:
        return self._work is not None

    def check_header(self) -> None:
        """Wait for the pending header; raise on every rank unless all are in the same phase."""
        work, self._work = self._work, None
        if work is None:
            return
        self.wait(work, "the phase header")  # a slow rank is fine: this waits the usual bound
        check_header(self._header, rank=self.rank, active=self.active())
        if self._kind == BACKWARD:
            rows = payloads(self._header)
            self._payloads = {r: rows[r] for r in self.active()}

    def exchange_header(self, kind: int) -> None:
        """Run a header to completion before a phase whose first collective must pair (a broadcast)."""
        self.launch_header(kind)
        self.check_header()

    def drop_header(self) -> None:
        """The backward raised: its header is not waited for."""
        self._work = None

    # ---------------------------------------------------------------- control and waits
    def launch_control(self, control: torch.Tensor) -> dist.Work:
        """All-reduce the end-of-backward control (after the buckets' collectives)."""
        return dist.all_reduce(control, group=self.group, async_op=True)

    def wait(self, handle: Any, what: str) -> None:
        """Wait for a Work or Future, bounded by the timeout, with a useful error."""
        if self.stream_waits and not is_future(handle):
            handle = _future_of(handle)
        try:
            if self.membership is not None:
                self.membership.wait(handle, self.timeout)
            else:
                bounded_wait(handle, self.timeout)
        except Exception as exc:
            # with elastic membership the reducer re-forms on a PeerFailure; without, it is a SyncError
            raise (SyncError if self.membership is None else PeerFailure)(
                f"gradsync: rank {self.rank} waited for {what} of synced backward {self.counters.sync} "
                f"(backward {self.counters.backward} on this rank) and it failed or did not finish within "
                f"{self.timeout.total_seconds():g}s: {exc}. Likely cause: another rank died, raised, "
                "skipped a backward, ran a different number of micro-steps, or disagreed about no_sync."
            ) from exc


def _future_of(work: Any) -> Any:
    try:
        return work.get_future()
    except RuntimeError:  # gloo's reduce-scatter has none: its wait is the only one
        return work


__all__ = ["ControlPlane", "Counters", "control_group", "reduces_cpu"]
