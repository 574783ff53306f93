"""Phase headers: every phase of collectives gradsync issues starts with the same small all-reduce.

gloo pairs the k-th collective of one rank with the k-th of every other rank, and two
collectives of different kinds (a buffer broadcast and a bucket all-reduce) never complete:
both ranks would wait for the process group's timeout, 30 minutes by default. So each phase
(the buffer broadcast of a training forward, a synced backward) first all-reduces a header of
the same shape on every rank: one row per rank, ``[kind, forward count, backward count,
payload...]``, each rank writing only its own row. Whatever phase each rank is in, the headers pair with each
other, every rank learns what every other rank is doing, and all raise the same diagnosis
before issuing anything that could not pair. A rank that is merely slow is not an error: the
others wait in the header for the usual bound.

The payload carries ``PAYLOAD`` float64 values per rank at no extra collective
(``GradientAccumulator``'s window: how it normalizes, its item count). Their bits travel as int64:
only its own rank writes a row and the other ranks add zeros, so the values arrive exactly.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .control import SyncError

FORWARD, BACKWARD = 1, 2  # a joined rank shadowing the others writes a row of zeros
PAYLOAD = 4  # float64 slots per rank


def header_tensor(rank: int, world_size: int, kind: int, forward_count: int, backward_count: int,
                  device: torch.device | None = None, payload: Sequence[float] = ()) -> torch.Tensor:
    """Return this rank's header; ``kind=0`` for a rank that takes part without a phase of its own."""
    if len(payload) > PAYLOAD:
        raise ValueError(f"gradsync: a phase header carries at most {PAYLOAD} values, got {len(payload)}")
    header = torch.zeros(world_size, 3 + PAYLOAD, dtype=torch.int64)
    if kind:
        values = list(payload) + [0.0] * (PAYLOAD - len(payload))
        bits = torch.tensor(values, dtype=torch.float64).view(torch.int64)
        header[rank] = torch.cat([torch.tensor([kind, forward_count, backward_count]), bits])
    return header.to(device) if device is not None else header


def payloads(header: torch.Tensor) -> list[tuple[float, ...]]:
    """Return each rank's payload from a reduced header (zeros for a joined rank)."""
    return [tuple(row) for row in header[:, 3:].cpu().contiguous().view(torch.float64).tolist()]


def describe(row: Sequence[int]) -> str:
    kind, forward, backward = row
    if kind == FORWARD:
        return f"started forward {forward + 1} (after backward {backward})"
    if kind == BACKWARD:
        return f"is finishing backward {backward} (after forward {forward})"
    return f"sent an unknown header {list(row)}"


def check_header(header: torch.Tensor, *, rank: int, active: Sequence[int]) -> None:
    """Raise on every rank unless the active ranks are in the same phase and no other rank is."""
    rows = [tuple(r[:3]) for r in header.cpu().tolist()]  # the payload may differ
    idle = [r for r in range(len(rows)) if r not in active]
    if len({rows[r] for r in active}) == 1 and rows[active[0]][0] in (FORWARD, BACKWARD) \
            and not any(any(rows[r]) for r in idle):
        return
    if any(any(rows[r]) for r in idle) or any(rows[r][0] not in (FORWARD, BACKWARD) for r in active):
        raise SyncError(
            f"gradsync: rank {rank}'s phase header paired with a different collective on another "
            f"rank (headers {[list(r) for r in rows]}, active ranks {list(active)}): the ranks ran "
            "different sequences of collectives, e.g. one is in model.join() or in a collective of "
            "its own. The process group is out of step; restart the job from a checkpoint."
        )
    detail = ", ".join(f"rank {r} {describe(rows[r])}" for r in active)
    raise SyncError(
        f"gradsync: the ranks are out of step: {detail}. A rank skipped a backward (a training "
        "forward with gradients enabled counts as one that needs a backward), skipped a "
        "micro-step, ran a different number of micro-steps in an accumulation window, or entered "
        "no_sync() when another did not. Detected on every rank before any gradient was applied; "
        "the process group is out of step, restart the job from a checkpoint."
    )
