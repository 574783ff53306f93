"""``bucket_cap_mb="auto"``: choose the bucket cap by timing synced backwards with each candidate.

Once the bucket order is final (re-planned after the first synced backward), the reducer
re-plans its buckets before every synced backward, cycling ``ROUNDS`` times through the
candidate caps that give distinct layouts (``CANDIDATES_MB``). Each synced backward is timed from
its first gradient to the end of its write-back: that span holds everything the cap changes
(launches, exposed communication, write-back) and, where collectives share cores with backward
(CPU), what communication costs the backward itself. A model of the link alone misses that last
part: one fit to the same traces chose 4 MiB buckets for gpt-12M, which measured slower than 25
(``benchmarks/results/speed-auto-cap-link-model-2cpu-2026-11-25.md``). The times are all-reduced with MAX (the slowest
rank sets the step) inside the next synced backward, before its commit (``gather``: a commit protocol
that re-forms the group gathers again among the survivors), so every rank makes the same choice at that
commit, and re-plans one last time.

The choice keeps torch's default 25 MiB unless a candidate beat it in every round and by more
than ``TIE`` at the median: on a shared CPU the candidates often differ by less than the noise of
a few samples, and the minimum of noisy medians would pick a layout by chance.

Where the link bounds the step, the timings say less than the link does: the same all-reduces
(each bucket's launch, done and bytes) give a link model, latency + bytes / bandwidth
(``fit_link``), and the gradient-ready times of the finest candidate give when each bucket of any
layout is ready (``predict_end``). When sending the whole gradient over that link takes longer
than the backward takes to produce it (``link_bound``: the link, not the CPU, sets the step), the
cap comes from the predicted end of communication, not from the timings (unless that cap measured
more than ``TIE`` slower than the default at the median); otherwise from the timings as above.
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .layout import plan_buckets
from .linkmodel import fit_link, param_ready, predict_end

CANDIDATES_MB = (1.0, 4.0, 16.0, 25.0, 64.0)
ROUNDS = 4  # a candidate that is no faster beats the default in every round with chance 1/16
TIE = 0.03
LINK_TIE = 0.005  # a larger cap must be predicted this close to the earliest end to be preferred
LINK_BOUND = 1.0  # link-bound: the whole gradient's link time exceeds this share of the backward's gradient span
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
    rule: str = "timed"  # "timed" or "link model" (what decided), "single layout", "resumed"
    link: dict = field(default_factory=dict)  # latency_ms, gbytes_s, link_ms, span_ms, link_bound, predicted_ms

    def as_dict(self) -> dict:
        return {"bucket_cap_mb": self.bucket_cap_mb, "first_bucket_cap_mb": self.first_bucket_cap_mb,
                "default_mb": self.default_mb, "measured_ms": dict(self.measured_ms),
                "rounds_ms": {c: list(t) for c, t in self.rounds_ms.items()}, "buckets": dict(self.buckets),
                "rule": self.rule, "link": dict(self.link)}


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


def choose_by_link(predicted: dict[float, float]) -> float:
    """The cap whose predicted end is earliest (of caps within ``LINK_TIE`` of it, the largest).

    No preference for torch's default here: where the link bounds the step, an idle link while a
    big bucket fills is time lost, whichever cap is torch's. The tie is narrow because the model
    errs one way: on the emulated 2 gbit link 16 MiB, predicted 2.6% later than 1 MiB, measured 5%
    slower, and a 3% tie made "auto" take it in some runs (results/speed-cluster-gap-2cpu-2026-11-26.md).
    """
    best = min(predicted.values())
    return max(cap for cap, t in predicted.items() if t <= best * (1 + LINK_TIE))


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
        self.records: dict[float, list[dict]] = {}  # cap -> the traced synced backwards timed with it
        self.choice: BucketChoice | None = None
        self.due = False  # the schedule is done: the next synced backward gathers the timings (gather)
        self.gathered: list[float] | None = None
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
            order = self.reducer.layout.order()
            self.layouts = distinct_layouts(params, order, self.first_bucket_cap_mb)
            self.default = default_cap(self.layouts, params, order, self.first_bucket_cap_mb)
            if len(self.layouts) == 1:  # every candidate plans the same buckets: nothing to time
                self.finish(BucketChoice(
                    bucket_cap_mb=self.default, first_bucket_cap_mb=first_cap(self.default, self.first_bucket_cap_mb),
                    default_mb=self.default, buckets={self.default: len(self.layouts[self.default])},
                    rule="single layout"))
                return
            self.schedule = [cap for _ in range(ROUNDS) for cap in self.layouts]
            self.times = {cap: [] for cap in self.layouts}
            self.records = {cap: [] for cap in self.layouts}
        elif record is not None and "backward_end" in record:
            self.times[self.current].append(record["backward_end"] - record["backward_start"])
            self.records[self.current].append(record)
        if self.reducer.trace is None:  # switched off meanwhile: trace the next ones
            self._own_trace = False
            self._start()
        if self.gathered is not None:
            self._decide(self.gathered)
        elif self.schedule:
            self.current = self.schedule.pop(0)
            self._apply(self.current)
        else:  # the next synced backward gathers every rank's timings before its commit (gather)
            self.due = True

    def _link_model(self, caps: list[float]) -> list[float]:
        """This rank's link model: [latency s, s per byte, whole gradient's link s, gradient span s,
        predicted end per cap]; zeros where its traces cannot tell (MAX over ranks: the slowest's)."""
        fit = fit_link([r for c in caps for r in self.records[c]])
        finest = min(caps)
        params = self.reducer.params
        ready = param_ready(self.records[finest], self.layouts[finest], len(params))
        if fit is None or ready is None:
            return [0.0] * (4 + len(caps))
        latency, bandwidth = fit
        record = self.records[finest][0]
        per_element = [b["bytes"] / max(1, sum(params[i].numel() for i in self.layouts[finest][b["index"]]))
                       for b in sorted(record["buckets"], key=lambda b: b["index"])]
        nbytes = [0.0] * len(params)
        for members, size in zip(self.layouts[finest], per_element):
            for i in members:
                nbytes[i] = params[i].numel() * size
        whole = latency + sum(nbytes) / bandwidth
        span = max(ready) - min(ready)
        return [latency, 1.0 / bandwidth, whole, span,
                *(predict_end(self.layouts[c], ready, nbytes, latency, bandwidth) for c in caps)]

    def gather(self) -> None:
        """Inside the synced backward after the last timed one, before its commit: every rank's timings,
        MAX over the ranks. A commit protocol that re-forms the group reduces, and gathers, again."""
        reducer, caps = self.reducer, list(self.layouts)
        # a round this rank did not time (it shadowed that backward, or joined later) counts 0: others timed it
        rows = [([0.0] * ROUNDS + self.times[c])[-ROUNDS:] for c in caps]
        link = self._link_model(caps)
        shared = torch.tensor([v for row in rows for v in row] + link, dtype=torch.float64, device=reducer.plane.device)
        if reducer.world_size > 1:  # MAX is exact in any order: every rank gets the same numbers
            reducer.wait(dist.all_reduce(shared, op=dist.ReduceOp.MAX, group=reducer.plane.group, async_op=True),
                         "the automatic bucket cap's timings")
        self.gathered = shared.tolist()

    def _decide(self, values: list[float]) -> None:
        caps = list(self.layouts)
        rounds = {c: [1e3 * t for t in values[k * ROUNDS:(k + 1) * ROUNDS]] for k, c in enumerate(caps)}
        latency, per_byte, whole, span, *ends = values[len(caps) * ROUNDS:]
        bound = per_byte > 0 and whole > LINK_BOUND * span
        predicted = {c: 1e3 * t for c, t in zip(caps, ends)}
        cap, rule = choose(rounds, self.default), "timed"
        if bound:  # the link model decides, unless its cap measured clearly slower than the default
            linked = choose_by_link(predicted)
            if statistics.median(rounds[linked]) <= statistics.median(rounds[self.default]) * (1 + TIE):
                cap, rule = linked, "link model"
            else:
                rule = "timed: the link model's cap measured slower"
        info = {} if per_byte <= 0 else {
            "latency_ms": 1e3 * latency, "gbytes_s": 1e-9 / per_byte, "link_ms": 1e3 * whole, "span_ms": 1e3 * span,
            "link_bound": bound, "predicted_ms": predicted}
        self.finish(BucketChoice(
            bucket_cap_mb=cap, first_bucket_cap_mb=first_cap(cap, self.first_bucket_cap_mb), default_mb=self.default,
            measured_ms={c: statistics.median(t) for c, t in rounds.items()}, rounds_ms=rounds,
            buckets={c: len(plan) for c, plan in self.layouts.items()}, rule=rule,
            link=info))

    def resume(self, bucket_cap_mb: float, first_bucket_cap_mb: float) -> tuple[float, float]:
        """Take caps chosen before (an interrupted run's gradient state); return them for the re-plan."""
        self.choice = BucketChoice(bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb, rule="resumed")
        self.schedule, self.times, self.records, self.due, self.gathered = [], {}, {}, False, None
        if self._own_trace:
            self.reducer.trace, self._own_trace = None, False
        return bucket_cap_mb, first_bucket_cap_mb

    def state(self) -> dict:
        """Where the members are: a replica that joins takes part from here (its missing rounds count 0)."""
        return {"choice": None if self.choice is None else self.choice.as_dict(),
                "planned": self.layouts is not None, "schedule": list(self.schedule), "current": self.current,
                "rounds": {c: len(t) for c, t in self.times.items()}, "due": self.due}

    def load_state(self, state: dict) -> None:
        if state["choice"] is not None:  # the members' whole record: every replica reports the same choice
            self.resume(state["choice"]["bucket_cap_mb"], state["choice"]["first_bucket_cap_mb"])
            self.choice = BucketChoice(**state["choice"])
            return
        if state["planned"]:
            order = self.reducer.layout.order()
            self.layouts = distinct_layouts(self.reducer.params, order, self.first_bucket_cap_mb)
            self.default = default_cap(self.layouts, self.reducer.params, order, self.first_bucket_cap_mb)
            self.records = {c: [] for c in self.layouts}
        self.schedule, self.current, self.due = list(state["schedule"]), state["current"], state["due"]
        self.times = {c: [0.0] * n for c, n in state["rounds"].items()}

    def finish(self, choice: BucketChoice) -> None:
        """Re-plan the buckets with ``choice``; tracing for this ends."""
        caps = self.resume(choice.bucket_cap_mb, choice.first_bucket_cap_mb)
        self.choice = choice
        self.reducer.layout.replan(self.reducer.layout.order(), caps)

    def _apply(self, cap: float) -> None:
        self.reducer.layout.replan(self.reducer.layout.order(), (cap, first_cap(cap, self.first_bucket_cap_mb)))


def syncs_to_choose(candidates: int) -> int:
    """Synced backwards before the choice: the one that re-plans the order, the schedule, the one that gathers."""
    return 2 + ROUNDS * candidates if candidates > 1 else 1


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


__all__ = ["AutoCaps", "BucketChoice", "CANDIDATES_MB", "LINK_BOUND", "LINK_TIE", "ROUNDS", "check_auto_cap_hook_state", "choose",
           "choose_by_link", "default_cap", "distinct_layouts", "first_cap", "fit_link", "param_ready", "predict_end",
           "syncs_to_choose"]
