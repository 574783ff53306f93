"""The end-of-backward control all-reduce, the checks it enables, and bounded waits.

Every synced backward ends with one small int32 all-reduce launched after the last bucket:
``[backward counter per rank | used count per parameter | forward counter per rank | failed flag
per rank | compute us, wait us and local squared norm per rank (telemetry.py) | present]``.
Each rank writes only its own counter slots, so the sum is an all-gather of the counters; the
used counts sum each rank's "this parameter produced a gradient" flag; ``present`` sums to the
number of ranks that took part. That one collective lets every rank notice diverging ranks, name
parameters that some rank produced no gradient for, find parameters unused on every rank, and
learn which ranks' backwards failed part-way (a skipped micro-step, ``engine/replay.py``).
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

from . import works
from .._torch import is_future


class SyncError(RuntimeError):
    """Ranks disagreed, a rank failed, or a collective did not finish within the timeout."""


def bounded_wait(handle: Any, timeout: timedelta) -> None:
    """Wait for a ``dist.Work`` or a future; raise its error, or TimeoutError after ``timeout``."""
    works.hold(handle)  # gloo's thread must never drop its last reference (works.py)
    if not is_future(handle):
        handle.wait(timeout)
        return
    if not handle.done():
        released = threading.Event()
        signal = lambda _fut: None  # noqa: E731
        # wake once gloo's thread has run the callback *and dropped it*, which takes the GIL (works.py)
        weakref.finalize(signal, released.set)
        handle.add_done_callback(signal)
        del signal
        if not released.wait(timeout.total_seconds()):
            raise TimeoutError("operation timed out")
    handle.wait()  # re-raises an error the future holds


def empty_control(world_size: int, n: int, device: torch.device | None = None) -> torch.Tensor:
    """Return a zero control: the contribution of a rank that takes no part (e.g. a joined one)."""
    return torch.zeros(6 * world_size + n + 1, dtype=torch.int32, device=device)


def control_tensor(rank: int, world_size: int, backward_count: int, forward_count: int,
                   used: Sequence[bool], device: torch.device | None = None, failed: int = 0,
                   times_us: tuple[int, int] = (0, 0), norm2: torch.Tensor | None = None) -> torch.Tensor:
    """Build this rank's control on ``device`` (NCCL reduces only tensors on the rank's GPU).

    ``failed``: 1 when this rank's backward failed part-way and its window can be reduced again
    without it, 2 when it cannot (it already held synced gradients of the window). ``times_us``:
    this rank's compute and wait (``telemetry.py``); ``norm2``: its local gradient's squared norm,
    a float32 whose bits ride in an int32 slot (the sum adds zeros to them: they arrive intact)."""
    w, n = world_size, len(used)
    control = empty_control(w, n)
    control[rank] = backward_count
    control[w:w + n] = torch.tensor(used, dtype=torch.int32)
    control[w + n + rank] = forward_count
    control[2 * w + n + rank] = failed
    control[3 * w + n + rank] = min(int(times_us[0]), 2**31 - 1)
    control[4 * w + n + rank] = min(int(times_us[1]), 2**31 - 1)
    control[-1] = 1
    control = control.to(device) if device is not None else control
    if norm2 is not None:
        control[5 * w + n + rank] = norm2.reshape(1).to(device=control.device, dtype=torch.float32).view(torch.int32)[0]
    return control


def telemetry(control: torch.Tensor, world_size: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the reduced control's per-rank [compute us | wait us] and local squared norms (float32)."""
    w = world_size
    return control[3 * w + n:5 * w + n], control[5 * w + n:6 * w + n].contiguous().view(torch.float32)


def used_counts(control: torch.Tensor, world_size: int, n: int) -> list[int]:
    """Return, per parameter, how many ranks produced a gradient for it."""
    return control[world_size:world_size + n].tolist()


def failed_ranks(control: torch.Tensor, world_size: int, n: int) -> dict[int, int]:
    """Return {rank: flag} for the ranks whose backward failed part-way and sent their buckets anyway."""
    flags = control[2 * world_size + n:3 * world_size + n].tolist()
    return {r: flag for r, flag in enumerate(flags) if flag}


def check_agreement(control: torch.Tensor, *, rank: int, world_size: int, n: int,
                    active: Sequence[int], sync_count: int) -> None:
    """Raise on every rank if the reduced control shows ranks out of step."""
    w = world_size
    backward = control[:w].tolist()
    forward = control[w + n:2 * w + n].tolist()
    idle = [r for r in range(w) if r not in active]
    if (int(control[-1]) != len(active) or any(backward[r] <= 0 for r in active)
            or any(backward[r] or forward[r] for r in idle)):
        raise SyncError(
            f"gradsync: rank {rank}'s end-of-backward check of synced backward {sync_count} paired "
            "with a different collective on another rank: the ranks ran different sequences of "
            "collectives (a rank skipped a backward or a forward, ran a different number of "
            "micro-steps, or disagreed about no_sync). No gradients were applied; the process group "
            "is out of step, restart the job from a checkpoint."
        )
    if len({backward[r] for r in active}) > 1 or len({forward[r] for r in active}) > 1:
        detail = ", ".join(f"rank {r}: forward {forward[r]}, backward {backward[r]}" for r in active)
        raise SyncError(
            f"gradsync: ranks disagree about which backward synchronizes gradients ({detail}). "
            "A rank skipped a backward (a forward without backward counts as skipped), ran a "
            "different number of micro-steps in an accumulation window, or entered no_sync() "
            "when another did not. No gradients were applied."
        )


def check_missing(counts: Sequence[int], names: Sequence[str], expected: int) -> None:
    """Raise if some rank produced no gradient for a parameter (without find_unused_parameters)."""
    absent = [names[i] for i, c in enumerate(counts) if c < expected]
    if absent:
        shown = ", ".join(absent[:20]) + (f" and {len(absent) - 20} more" if len(absent) > 20 else "")
        raise RuntimeError(
            f"gradsync: {len(absent)} parameter(s) received no gradient in this backward on at least "
            f"one rank: {shown}. If some parameters are not used in every iteration, construct "
            "DistributedDataParallel with find_unused_parameters=True. The gradients were not "
            "synchronized; do not step the optimizer on them."
        )


def check_finite(results: Sequence[torch.Tensor], members: Sequence[Sequence[int]],
                 params: Sequence[torch.Tensor], names: Sequence[str]) -> None:
    """Raise naming the parameters whose reduced gradient holds NaN or inf (one check per bucket)."""
    if bool(torch.stack([torch.isfinite(r).all() for r in results]).all()):
        return
    bad = [names[i] for result, idx in zip(results, members)
           for i, part in zip(idx, result.reshape(-1).split([params[i].numel() for i in idx]))
           if not bool(torch.isfinite(part).all())]
    raise FloatingPointError(
        f"gradsync: the synchronized gradient of {len(bad)} parameter(s) contains NaN or inf: "
        f"{', '.join(bad[:20])}{' ...' if len(bad) > 20 else ''} (on at least one rank the local "
        "gradient was not finite). The gradients were not written back; skip this step "
        "(optimizer.zero_grad()) or lower the learning rate / use loss scaling."
    )


def check_grad(grad: torch.Tensor, view: torch.Tensor, name: str) -> None:
    """Raise unless ``grad`` can be copied into its bucket slot ``view`` without conversion."""
    if grad.layout != torch.strided:
        raise RuntimeError(f"gradsync: parameter '{name}' has a {grad.layout} gradient; only dense "
                           "gradients are supported (e.g. nn.Embedding(sparse=False))")
    if grad.dtype != view.dtype:
        raise RuntimeError(f"gradsync: parameter '{name}' has a {grad.dtype} gradient, but it and its "
                           f"bucket are {view.dtype}; assign gradients of the parameter's dtype")
    if grad.shape != view.shape:
        raise RuntimeError(f"gradsync: parameter '{name}' has a gradient of shape {tuple(grad.shape)}, "
                           f"expected {tuple(view.shape)}")
