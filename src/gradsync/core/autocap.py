"""``bucket_cap_mb="auto"``: choose the bucket cap by timing synced backwards with each candidate.

Once the bucket order is final (re-planned after the first synced backward), the reducer
re-plans its buckets before every synced backward, cycling ``ROUNDS`` times through the
candidate caps that give distinct layouts (``CANDIDATES_MB``). Each synced backward is timed from
its first gradient to the end of its write-back: that span holds everything the cap changes
(launches, exposed communication, write-back) and, where collectives share cores with backward
(CPU), what communication costs the backward itself. A model of the link alone misses that last
part: one fit to the same traces chose 4 MiB buckets for gpt-12M, which measured slower than 25
(``benchmarks/results/auto_cap-link-model.md``). The times are all-reduced with MAX (the slowest
rank sets the step), so every rank makes the same choice, and re-plans one last time.

The choice keeps torch's default 25 MiB unless a candidate beat it in every round and by more
than ``TIE`` at the median: on a shared CPU the candidates often differ by less than the noise of
a few samples, and the minimum of noisy medians would pick a layout by chance.
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .buckets import plan_buckets

CANDIDATES_MB = (1.0, 4.0, 16.0, 25.0, 64.0)
ROUNDS = 4  # a candidate that is no faster beats the default in every round with chance 1/16
TIE = 0.03
DEFAULT_MB = 25.0  # torch's default cap: kept unless another candidate is clearly faster
DEFAULT_FIRST_MB = 1.0  # torch's first bucket


@dataclass(kw_only=True)
class BucketChoice:
    """What ``bucket_cap_mb="auto"`` chose and from what (``model.bucket_choice``)."""

    bucket_cap_mb: float
    first_bucket_cap_mb: float
    default_mb: float | None = None  # the candidate with torch's default layout (25 MiB)
    measured_ms: dict[float, float] = field(default_factory=dict)  # cap -> median synced backward, max over ranks
    rounds_ms: dict[float, list[float]] = field(default_factory=dict)  # cap -> each round's synced backward
    buckets: dict[float, int] = field(default_factory=dict)  # cap -> number of buckets

    def as_dict(self) -> dict:
        return {"bucket_cap_mb": self.bucket_cap_mb, "first_bucket_cap_mb": self.first_bucket_cap_mb,
                "default_mb": self.default_mb, "measured_ms": dict(self.measured_ms),
                "rounds_ms": {c: list(t) for c, t in self.rounds_ms.items()}, "buckets": dict(self.buckets)}


def first_cap(cap: float, user_first: float | None) -> float:
    """The first bucket's cap with ``cap``: the user's, else torch's 1 MiB or ``cap`` if smaller."""
    return min(DEFAULT_FIRST_MB, cap) if user_first is None else user_first


def distinct_layouts(params: Sequence[torch.Tensor], order: Sequence[int] | None, user_first: float | None,
                     candidates: Sequence[float] = CANDIDATES_MB) -> dict[float, list[list[int]]]:
    """Map each candidate cap that plans a layout no smaller candidate plans to that layout."""
    layouts: dict[float, list[list[int]]] = {}
    for cap in sorted(candidates):
        plan = plan_buckets(params, cap, first_cap(cap, user_first), order)
        if plan not in layouts.values():
            layouts[cap] = plan
    return layouts


def default_cap(layouts: dict[float, list[list[int]]], params: Sequence[torch.Tensor], order: Sequence[int] | None,
                user_first: float | None) -> float:
    """The candidate whose layout is the one ``DEFAULT_MB`` plans."""
    plan = plan_buckets(params, DEFAULT_MB, first_cap(DEFAULT_MB, user_first), order)
    return next(cap for cap, layout in layouts.items() if layout == plan)


def choose(rounds: dict[float, list[float]], default: float) -> float:
    """``default``, unless a cap was faster in every round and by more than ``TIE`` at the median.

    Of several such caps, the fastest; within ``TIE`` of it, the largest (fewer buckets).
    """
    base = statistics.median(rounds[default])
    clear = {cap: statistics.median(t) for cap, t in rounds.items()
             if cap != default and all(a < b for a, b in zip(t, rounds[default]))
             and statistics.median(t) < base * (1 - TIE)}
    if not clear:
        return default
    best = min(clear.values())
    return max(cap for cap, t in clear.items() if t <= best * (1 + TIE))


class AutoCaps:
    """The reducer's ``bucket_cap_mb="auto"`` state: time each candidate, then choose once.

    It reads the reducer's parameters, trace and plan order, and changes the buckets only through
    ``reducer.layout.replan`` (the store owns the caps in use; Dynamo's graph splits read them there).
    """

    def __init__(self, first_bucket_cap_mb: float | None, reducer):
        self.reducer = reducer
        self.first_bucket_cap_mb = first_bucket_cap_mb  # the user's, or None for torch's default
        self.layouts: dict[float, list[list[int]]] | None = None
        self.default: float | None = None  # the candidate with DEFAULT_MB's layout
        self.schedule: list[float] = []  # caps still to time, in order
        self.current: float | None = None  # the cap the next synced backward runs with
        self.times: dict[float, list[float]] = {}
        self.choice: BucketChoice | None = None
        self._own_trace = False
        self._start()

    def _start(self) -> None:
        if self.reducer.trace is None:
            self.reducer.trace, self._own_trace = [], True

    def keep_trace(self) -> None:
        """The user asked for the trace: leave it on after the choice."""
        self._own_trace = False

    def observe(self, record: dict | None) -> None:
        """After a synced backward (``record`` None: not traced here, e.g. shadowed by a joined rank).

        Every rank takes part in every synced backward (a joined one shadows it), so every rank
        moves through the schedule, and reaches the closing all-reduce, at the same backward.
        """
        params = self.reducer.params
        if self.layouts is None:  # the order is final by now: plan the schedule, time from the next one
            order = self._order()
            self.layouts = distinct_layouts(params, order, self.first_bucket_cap_mb)
            self.default = default_cap(self.layouts, params, order, self.first_bucket_cap_mb)
            if len(self.layouts) == 1:  # every candidate plans the same buckets: nothing to time
                self.finish(BucketChoice(
                    bucket_cap_mb=self.default, first_bucket_cap_mb=first_cap(self.default, self.first_bucket_cap_mb),
                    default_mb=self.default, buckets={self.default: len(self.layouts[self.default])}))
                return
            self.schedule = [cap for _ in range(ROUNDS) for cap in self.layouts]
            self.times = {cap: [] for cap in self.layouts}
        elif record is not None and "backward_end" in record:
            self.times[self.current].append(record["backward_end"] - record["backward_start"])
        if self.reducer.trace is None:  # switched off meanwhile: trace the next ones
            self._own_trace = False
            self._start()
        if self.schedule:
            self.current = self.schedule.pop(0)
            self._apply(self.current)
        else:
            self._agree()

    def _agree(self) -> None:
        reducer, caps = self.reducer, list(self.layouts)
        # a round this rank did not time (it shadowed that backward) counts 0: other ranks timed it
        times = torch.tensor([(self.times[c] + [0.0] * ROUNDS)[:ROUNDS] for c in caps],
                             dtype=torch.float64, device=reducer.device)
        if reducer.world_size > 1:  # MAX is exact in any order: every rank gets the same numbers
            reducer.wait(dist.all_reduce(times, op=dist.ReduceOp.MAX, group=reducer.group, async_op=True),
                         "the automatic bucket cap's timings")
        rounds = {c: [1e3 * t for t in row] for c, row in zip(caps, times.tolist())}
        cap = choose(rounds, self.default)
        self.finish(BucketChoice(
            bucket_cap_mb=cap, first_bucket_cap_mb=first_cap(cap, self.first_bucket_cap_mb), default_mb=self.default,
            measured_ms={c: statistics.median(t) for c, t in rounds.items()}, rounds_ms=rounds,
            buckets={c: len(plan) for c, plan in self.layouts.items()}))

    def resume(self, bucket_cap_mb: float, first_bucket_cap_mb: float) -> tuple[float, float]:
        """Take caps chosen before (an interrupted run's gradient state); return them for the re-plan."""
        self.choice = BucketChoice(bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb)
        self.schedule, self.times = [], {}
        if self._own_trace:
            self.reducer.trace, self._own_trace = None, False
        return bucket_cap_mb, first_bucket_cap_mb

    def finish(self, choice: BucketChoice) -> None:
        """Re-plan the buckets with ``choice``; tracing for this ends."""
        caps = self.resume(choice.bucket_cap_mb, choice.first_bucket_cap_mb)
        self.choice = choice
        self.reducer.layout.replan(self._order(), caps)

    def _apply(self, cap: float) -> None:
        self.reducer.layout.replan(self._order(), (cap, first_cap(cap, self.first_bucket_cap_mb)))

    def _order(self) -> list[int]:
        # no observed order (find_unused_parameters keeps registration order): plan_buckets' default walk
        return self.reducer.store.plan_order or list(range(len(self.reducer.params) - 1, -1, -1))


def syncs_to_choose(candidates: int) -> int:
    """Synced backwards before the choice: the one that re-plans the order, then the schedule."""
    return 1 + ROUNDS * candidates if candidates > 1 else 1


def check_auto_cap_hook_state(auto: AutoCaps | None, state) -> None:
    """Refuse a hook state keyed by bucket index that would outlive a layout "auto" still changes.

    torch's PowerSGD keeps error feedback and warm-start matrices per bucket index from
    ``start_powerSGD_iter`` on; a bucket re-planned after that would meet another bucket's state.
    """
    start = getattr(state, "start_powerSGD_iter", None)
    bound = syncs_to_choose(len(CANDIDATES_MB))
    if auto is None or auto.choice is not None or not isinstance(start, int) or start >= bound:
        return
    raise ValueError(
        f"gradsync: bucket_cap_mb=\"auto\" re-plans the buckets during up to the first {bound} synced "
        f"backwards, but this hook state keeps per-bucket tensors from start_powerSGD_iter={start} on. "
        f"Pass start_powerSGD_iter >= {bound}, or a number as bucket_cap_mb.")


__all__ = ["AutoCaps", "BucketChoice", "CANDIDATES_MB", "ROUNDS", "check_auto_cap_hook_state", "choose",
           "default_cap", "distinct_layouts", "first_cap", "syncs_to_choose"]
