"""What torch's DDP offers besides training, for code written against it: its attributes, pickling,
and the private switches frameworks call (Lightning reads ``_get_ddp_logging_data()`` at teardown)."""
from __future__ import annotations

import copy
import warnings
from typing import Any, NoReturn

import torch.distributed as dist

from ..engine import messages
from .._torch import disabled_join_config
from .compile import bucket_bytes_caps


class TorchDDPExtras:
    """Mixed into ``DistributedDataParallel``; uses its ``reducer``, ``process_group`` and options."""

    # torch's attributes, read from the one configuration
    find_unused_parameters = property(lambda self: self.reducer.config.find_unused_parameters)
    gradient_as_bucket_view = property(lambda self: self.reducer.config.gradient_as_bucket_view)
    static_graph = property(lambda self: self.reducer.config.static_graph)
    timeout = property(lambda self: self.reducer.config.timeout)

    @property
    def bucket_bytes_cap(self) -> int:
        """The bucket cap in bytes. Dynamo's DDP optimizer splits compiled graphs at it; it follows
        the caps in use (``bucket_cap_mb="auto"`` changes them while it chooses)."""
        return bucket_bytes_caps(*self.reducer.store.caps)[0]

    def __getstate__(self) -> dict[str, Any]:
        """Pickle without the process group and reducer (``torch.save(model)``), as torch does."""
        if self.process_group != dist.group.WORLD:
            raise RuntimeError("DDP Pickling/Unpickling are only supported when using DDP with the default "
                               "process group. That is, when you have called init_process_group and have "
                               "not passed process_group argument to DDP constructor")
        attrs = copy.copy(self.__dict__)
        attrs["_reducer_config"] = self.reducer.config
        for name in ("process_group", "reducer", "_join", "_delayed"):
            del attrs[name]
        attrs["_join_config"] = disabled_join_config()
        return attrs

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild on the default process group: a fresh reducer, no collective."""
        self.process_group = dist.group.WORLD
        config = state.pop("_reducer_config")
        super().__setstate__(state)
        self._build_reducer(config)

    def _set_static_graph(self) -> None:
        """Turn on ``static_graph`` after construction (torch's private API), before any backward."""
        if self.reducer.backward_count:
            self._log_and_throw(RuntimeError, "gradsync: _set_static_graph() should be called before training "
                                "loop starts (construct the wrapper with static_graph=True instead)")
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.", stacklevel=2)
            return
        self.reducer.set_static_graph()

    def _log_and_throw(self, err_type: type[Exception], err_msg: str) -> NoReturn:
        """Raise ``err_type(err_msg)`` and keep it for ``_get_ddp_logging_data()`` (torch's private helper)."""
        raise self._log_error(err_type(err_msg))

    def _log_error(self, exc: Exception) -> Exception:
        """Keep ``exc`` as the latest error of ``_get_ddp_logging_data()``; return it."""
        self.reducer.last_error = messages.logged(exc, wrapper=True)
        return exc

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """A few of torch's logging fields (frameworks read it at teardown); gradsync runs no C++ logger.

        As torch's: ``has_error`` (1) and ``error`` appear once the wrapper or its reducer raised (the
        latest error: the wrapper's checks in torch's form ``"<class 'TypeError'>: ..."``, the reducer's
        message as raised); ``num_buckets_reduced`` is the number of
        buckets the latest synced backward reduced (fewer than ``num_buckets`` with
        ``skip_all_reduce_unused_params``), absent before the first. ``can_set_static_graph`` is 0:
        gradsync does not analyse whether the graph was static.
        """
        reducer = self.reducer
        data = {"world_size": self.world_size, "rank": reducer.rank, "backend_name": dist.get_backend(
                    self.process_group), "find_unused_parameters": int(self.find_unused_parameters),
                "static_graph": int(self.static_graph), "gradient_as_bucket_view": int(self.gradient_as_bucket_view),
                "num_buckets": len(reducer.buckets), "iteration": reducer.sync_count, "can_set_static_graph": 0}
        if reducer.skips.reduced is not None:
            data["num_buckets_reduced"] = reducer.skips.reduced
        errors = [e for e in (reducer.last_error, reducer.expected.error) if e is not None]
        if errors:
            data["has_error"], data["error"] = 1, max(errors)[1]
        return data
