"""What a skipped micro-step needs beside the accumulator: the exception, checks, and the record exchange.

A micro-step ends early on one rank through ``acc.skip(reason)``, an exception listed in
``skip_on`` (in forward or backward), or, with ``skip_nonfinite=True``, a NaN/inf loss. The
window's gradient is then the exact mean over what ran (``accumulate.py``), and
``acc.skipped`` lists every rank's skips, the same on every rank. The skip records travel in one
extra pair of collectives, only in a window where some rank skipped (the phase header tells every
rank whether to expect them).
"""
from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from ..engine.errors import SyncError

# Never skipped, whatever skip_on says: after these the process or its group is not usable
# (ranks out of step, a broken link, an interrupt), or the code itself is wrong.
NEVER_SKIPPED = (SyncError, dist.DistError, KeyboardInterrupt, SystemExit, AssertionError, NameError,
                 AttributeError, TypeError, SyntaxError)


class SkipMicroStep(Exception):
    """Raised by ``acc.skip()``: ends the micro-step on this rank (caught by ``accumulate()``)."""


def check_skip_on(skip_on: Any) -> tuple[type[BaseException], ...]:
    """Return ``skip_on`` as a tuple of exception classes; refuse what must never be skipped."""
    kinds = (skip_on,) if isinstance(skip_on, type) else tuple(skip_on or ())
    for kind in kinds:
        if not (isinstance(kind, type) and issubclass(kind, Exception)):
            raise TypeError(f"gradsync: skip_on takes exception classes (e.g. torch.OutOfMemoryError), got {kind!r}")
        if issubclass(kind, NEVER_SKIPPED) or kind in (Exception, RuntimeError):
            raise ValueError(
                f"gradsync: skip_on=({kind.__name__},) would also skip errors after which the process group or "
                "the program is not usable (gradsync.SyncError, torch.distributed errors, programming errors). "
                "Name the failures a micro-step may survive, e.g. skip_on=(torch.OutOfMemoryError,)")
    return kinds


def skippable(exc: BaseException, skip_on: tuple[type[BaseException], ...]) -> bool:
    return isinstance(exc, SkipMicroStep) or (isinstance(exc, skip_on) and not isinstance(exc, NEVER_SKIPPED))


def reason_of(exc: BaseException) -> str:
    if isinstance(exc, SkipMicroStep):
        return str(exc)
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 200 else text[:197] + "..."


def exchange_records(records: list[tuple[int, str]], *, rank: int, world_size: int, group: Any,
                     device: torch.device, wait: Any) -> list[tuple[int, int, str]]:
    """Gather every rank's (micro_step, reason) records; return (rank, micro_step, reason) sorted.

    Two bounded collectives: the longest record's size, then every rank's records padded to it.
    """
    mine = torch.frombuffer(bytearray(pickle.dumps(records)), dtype=torch.uint8)
    size = torch.tensor([mine.numel()], dtype=torch.int64, device=device)
    wait(dist.all_reduce(size, op=dist.ReduceOp.MAX, group=group, async_op=True), "the size of the skip records")
    padded = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    padded[:mine.numel()] = mine.to(device)
    everyone = [torch.empty_like(padded) for _ in range(world_size)]
    wait(dist.all_gather(everyone, padded, group=group, async_op=True), "the skip records")
    out = []
    for r, data in enumerate(everyone):
        # pickle stops at its own end: the zero padding after it is never read
        out += [(r, step, reason) for step, reason in pickle.loads(data.cpu().numpy().tobytes())]
    return sorted(out)


__all__ = ["NEVER_SKIPPED", "SkipMicroStep", "check_skip_on", "exchange_records", "reason_of", "skippable"]
