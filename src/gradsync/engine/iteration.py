"""What one backward has seen: the reducer's per-iteration state, replaced at each synced backward."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class IterationState:
    """What the current backward has seen; replaced at the start of each synced backward."""

    in_backward: bool = False
    syncing: bool = False
    compiled_autograd: bool = False  # under compiled autograd no queued callback runs (ddp/compile.py)
    ready: list[bool] = field(default_factory=list)
    hook_counts: list[int] = field(default_factory=list)
    next_launch: int = 0  # the lowest bucket index not launched yet
    hooked: list[bool] | None = None  # which parameters this backward's hooks made ready (kept for a redo)
    t_ready: float | None = None  # when the latest gradient of a synced backward was ready (telemetry.py)
    hook_wait: float = 0.0  # seconds its hooks waited on the phase header (others' work, not this rank's)
    norm2: Any = None  # with measure_norm: the squared norm of what went into the buckets
    record: dict | None = None  # this backward's comm trace, when tracing
    divide: bool = True  # the store divides as it copies in (read once per synced backward)
    checked: bool = False  # the graph decides readiness (static_graph, or a gradient seen twice: graph.py)
    order: list[int] | None = None  # the first synced backward's gradient-ready order (layout.py)
    per_bucket: bool = False  # gradients are copied in per full bucket (the store's copies_per_bucket)
    fast: bool = False  # the hooks count gradients in without a call (reducer._hook)
    adopt: bool = False  # gradient views: a local backward's hook makes a replaced .grad its slot again

    def restart(self, n: int) -> None:
        """Launch every bucket again (a new group): the hooks so far are all this backward had."""
        self.norm2 = None  # measured again as the buckets launch again
        if self.hooked is None:
            self.hooked = list(self.ready)
        self.ready, self.hook_counts, self.next_launch = [False] * n, [0] * n, 0


__all__ = ["IterationState"]
