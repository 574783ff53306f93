"""The reducer's longer error and warning texts, kept out of the state machine so it reads top to bottom."""
from __future__ import annotations

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
    return (f"gradsync: static_graph=True, but parameter '{name}' produced a gradient "
            f"{count} times in this backward and {expected} times in the first "
            "iteration. The graph changed; construct the model with static_graph=False.")


def static_graph_missing(names: str) -> str:
    return (f"gradsync: static_graph=True, but parameter(s) {names} produced no gradient in this "
            "backward although they did in the first iteration. The graph changed; construct the "
            "model with static_graph=False (and find_unused_parameters=True if needed).")


def ready_twice(name: str) -> str:
    return (f"gradsync: parameter '{name}' was marked ready twice in one backward: it took "
            "part in the backward more than once (e.g. reentrant activation checkpointing, or a "
            "module reused across a nested backward). Pass static_graph=True if the graph is the "
            "same every iteration, or use torch.utils.checkpoint(..., use_reentrant=False).")
