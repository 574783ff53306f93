"""The reducer's longer error and warning texts, kept out of the state machine so it reads top to bottom."""
from __future__ import annotations

import itertools
import zlib
from collections.abc import Sequence
from typing import Any

_ERRORS = itertools.count()  # orders the errors a wrapper's parts log (the latest one is reported)


def logged(exc: BaseException, wrapper: bool = False) -> tuple[int, str]:
    """What torch's DDP logger keeps of an error (``_get_ddp_logging_data()["error"]``), with a number
    ordering it among the others: the message as the reducer raised it, or for the wrapper's own checks
    torch's Python form ``"<class 'RuntimeError'>: message"``."""
    return next(_ERRORS), f"{type(exc)}: {exc}" if wrapper else str(exc)

COMPILED_AUTOGRAD_UNFINISHED = (
    "gradsync: under compiled autograd a synced backward ends when its last bucket "
    "launches, and the previous one ended with buckets unlaunched: some parameters "
    "expected to get a gradient got none (find_unused_parameters with a parameter used "
    "only in earlier no_sync micro-steps, or static_graph's first iteration). Set "
    "torch._dynamo.config.compiled_autograd = False for such steps.")

UNPREPARED_BACKWARD = (
    "gradsync: a backward ran without a forward of the DistributedDataParallel model "
    "since the previous backward (a second backward through one forward, or a forward "
    "that bypassed the wrapper). As in torch, its gradients were not synchronized now; "
    "they are reduced at the next synchronizing backward. Call model(...) before each "
    "backward; to combine several losses from one forward, add them and call backward once.")


def static_graph_extra(name: str, count: int, expected: int) -> str:
    # torch's sentence first (its tests match it), then what gradsync knows
    return ("gradsync: Your training graph has changed in this iteration, e.g., one parameter is unused "
            "in first iteration, but then got used in the second iteration. this is not compatible with "
            f"static_graph set to True. With static_graph=True, parameter '{name}' produced a gradient {count} "
            f"times in this backward and {expected} times in the first iteration: the graph changed; construct "
            "the model with static_graph=False.")


def static_graph_missing(names: str, rank: int, indices: str) -> str:
    # torch's sentence (its test_invalid_static_graph matches it), though gradsync raises it in the backward
    # that missed the gradients, not at the next forward; then what gradsync knows
    return ("gradsync: Expected to have finished reduction in the prior iteration before starting a new one. "
            "This error indicates that your training graph has changed in this iteration, e.g., one parameter "
            "is used in first iteration, but then got unused in the second iteration. this is not compatible "
            f"with static_graph set to True.\nParameter indices which did not receive grad for rank {rank}: "
            f"{indices}\nWith static_graph=True, parameter(s) {names} produced no gradient in this backward "
            "although they did in the first iteration (gradsync raises in this backward, before any optimizer "
            "step): the graph changed; construct the model with static_graph=False (and "
            "find_unused_parameters=True if needed).")


def ready_twice(name: str) -> str:
    return (f"gradsync: parameter '{name}' was marked ready twice in one backward: it took "
            "part in the backward more than once (e.g. reentrant activation checkpointing, or a "
            "module reused across a nested backward). Pass static_graph=True if the graph is the "
            "same every iteration, or use torch.utils.checkpoint(..., use_reentrant=False).")


RESCALE_AFTER_OVERLAP = (
    "gradsync: gradients must be rescaled after the synced backward (GradientAccumulator with num_items, or a "
    "window that ended early), but overlap_optimizer already stepped on them inside that backward. Use mean "
    "losses over full windows, or remove overlap_optimizer.")


def out_of_step(rank: int, sync: int) -> str:
    return (f"gradsync: rank {rank}'s end-of-backward check of synced backward {sync} paired with a "
            "different collective on another rank: the ranks ran different sequences of collectives (a "
            "rank skipped a backward or a forward, ran a different number of micro-steps, or disagreed "
            "about no_sync). No gradients were applied; the process group is out of step, restart the "
            "job from a checkpoint.")


def phase_mismatch(detail: str) -> str:
    return (f"gradsync: ranks disagree about which backward synchronizes gradients ({detail}). A rank "
            "skipped a backward (a forward without backward counts as skipped), ran a different number "
            "of micro-steps in an accumulation window, or entered no_sync() when another did not. No "
            "gradients were applied.")


def foreign_header(rows: list[tuple[int, int, int]], *, rank: int, active: Sequence[int]) -> str:
    return (f"gradsync: rank {rank}'s phase header paired with a different collective on another "
            f"rank (headers {[list(r) for r in rows]}, active ranks {list(active)}): the ranks ran "
            "different sequences of collectives, e.g. one is in model.join() or in a collective of "
            "its own. The process group is out of step; restart the job from a checkpoint.")


def hook_id(hook: Any) -> tuple[int, str]:
    """A comm hook's id for the phase header (0: none) and its name, the same on every rank for the same hook."""
    if hook is None:
        return 0, "none"
    fn = getattr(hook, "func", hook)  # functools.partial
    name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
    return zlib.crc32(name.encode()) + 1, name


def hooks_differ(ids: dict[int, int], rank: int, name: str) -> str:
    """``ids``: each active rank's hook id; ``name``: this rank's hook."""
    others = ", ".join(f"rank {r}: {'none' if i == 0 else 'the same' if i == ids[rank] else 'another'}"
                       for r, i in ids.items() if r != rank)
    return (f"gradsync: the ranks registered different communication hooks: rank {rank} runs {name} ({others}). "
            "Call register_comm_hook with the same hook on every rank before the first backward. Detected on every "
            "rank before any bucket was reduced; no gradient was applied.")


def phases_out_of_step(phases: list[tuple[int, int, int, int]]) -> str:
    """``phases``: (rank, its header's kind: 1 forward, 2 backward, 3 audit, its forward count, its backward count)."""
    where = {1: "started forward {f1} (after backward {b})", 2: "is finishing backward {b} (after forward {f})",
             3: "is in gradsync.audit (after forward {f}, backward {b})"}
    detail = ", ".join(f"rank {r} " + where[kind].format(f=f, f1=f + 1, b=b) for r, kind, f, b in phases)
    return (f"gradsync: the ranks are out of step: {detail}. A rank skipped a backward (a training "
            "forward with gradients enabled counts as one that needs a backward), skipped a "
            "micro-step, ran a different number of micro-steps in an accumulation window, entered "
            "no_sync() or called gradsync.audit() when another did not, or ran its forward in eval mode (model.eval(): "
            "not counted as a training forward) while another trained. Detected on every rank before any gradient was applied; "
            "the process group is out of step, restart the job from a checkpoint.")


def wait_failed(rank: int, what: str, sync: int, backward: int, timeout: float, exc: BaseException) -> str:
    waited = f"gradsync: rank {rank} waited for {what} of synced backward {sync} (backward {backward} on this rank)"
    if not isinstance(exc, TimeoutError) and "timed out" not in str(exc).lower():
        return (f"{waited} and it failed: {type(exc).__name__}: {exc}. A closed or reset connection means another "
                "rank died or raised; any other error came from this rank (its communication hook, or a callback "
                "chained on the hook's future).")
    return (f"{waited} and it did not finish within {timeout:g}s: {exc}. Likely cause: another rank died, raised, "
            "skipped a backward, ran a different number of micro-steps, or disagreed about no_sync; or one backward "
            "runs through several wrapped models in a different order on different ranks (each waits in the first "
            "model it reaches: keep the order the same); or the network between the ranks is cut or stalled.")
