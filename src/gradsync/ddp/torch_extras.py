"""What torch's DDP offers besides training, for code written against it: pickling, the private switches
frameworks call (Lightning reads ``_get_ddp_logging_data()`` at teardown), and the comm trace export.

Functions of the wrapper; ``DistributedDataParallel`` names each as a method of torch's name.
"""
from __future__ import annotations

import copy
import json
import warnings
from dataclasses import replace
from typing import Any

import torch.distributed as dist

from .._torch import disabled_join_config
from ..engine import messages
from ..engine.telemetry import chrome_trace


def getstate(ddp: Any) -> dict[str, Any]:
    """Pickle without the process group and reducer (``torch.save(model)``), as torch does."""
    if ddp.process_group != dist.group.WORLD:
        raise RuntimeError("DDP Pickling/Unpickling are only supported when using DDP with the default "
                           "process group. That is, when you have called init_process_group and have "
                           "not passed process_group argument to DDP constructor")
    attrs = copy.copy(ddp.__dict__)
    attrs["reducer_config"] = ddp.reducer.config
    for name in ("process_group", "reducer", "join_state", "delayed"):
        del attrs[name]
    attrs["_join_config"] = disabled_join_config()  # torch's Joinable attribute
    return attrs


def set_static_graph(ddp: Any) -> None:
    """Turn on ``static_graph`` after construction (torch's private API), before any backward."""
    if ddp.reducer.backward_count:
        raise log_error(ddp, RuntimeError("gradsync: _set_static_graph() should be called before training loop "
                                          "starts (construct the wrapper with static_graph=True instead)"))
    if ddp.static_graph:
        warnings.warn("You've set static_graph to be True, no need to set it again.", stacklevel=3)
        return
    ddp.reducer.config = replace(ddp.reducer.config, static_graph=True)


def log_error(ddp: Any, exc: Exception) -> Exception:
    """Keep ``exc`` as the latest error of ``_get_ddp_logging_data()``; return it."""
    ddp.reducer.last_error = messages.logged(exc, wrapper=True)
    return exc


def logging_data(ddp: Any) -> dict[str, Any]:
    """A few of torch's logging fields (frameworks read it at teardown); gradsync runs no C++ logger.

    As torch's: ``has_error`` (1) and ``error`` appear once the wrapper or its reducer raised (the
    latest error: the wrapper's checks in torch's form ``"<class 'TypeError'>: ..."``, the reducer's
    message as raised); ``num_buckets_reduced`` is the number of buckets the latest synced backward
    reduced (fewer than ``num_buckets`` with ``skip_all_reduce_unused_params``), absent before the
    first. ``can_set_static_graph`` is 0: gradsync does not analyse whether the graph was static.
    """
    reducer = ddp.reducer
    data = {"world_size": ddp.world_size, "rank": reducer.rank, "backend_name": dist.get_backend(ddp.process_group),
            "find_unused_parameters": int(ddp.find_unused_parameters), "static_graph": int(ddp.static_graph),
            "gradient_as_bucket_view": int(ddp.gradient_as_bucket_view), "num_buckets": len(reducer.buckets),
            "iteration": reducer.sync_count, "can_set_static_graph": 0}
    if reducer.skips.reduced is not None:
        data["num_buckets_reduced"] = reducer.skips.reduced
    errors = [e for e in (reducer.last_error, reducer.expected.error) if e is not None]
    if errors:
        data["has_error"], data["error"] = 1, max(errors)[1]
    return data


def export_trace(ddp: Any, path: str) -> None:
    """Write every rank's comm trace to ``path`` as one Chrome trace / Perfetto JSON (rank 0 writes)."""
    if ddp.reducer.trace is None:
        raise RuntimeError("gradsync: export_trace() draws the comm trace: call model.enable_comm_trace() "
                           "before the synced backwards you want to see")
    everyone: list[Any] = [None] * ddp.world_size
    dist.all_gather_object(everyone, ddp.reducer.trace, group=ddp.process_group)
    if dist.get_rank(ddp.process_group) == 0:
        with open(path, "w") as f:
            json.dump(chrome_trace(everyone), f)


__all__ = ["export_trace", "getstate", "log_error", "logging_data", "set_static_graph"]
