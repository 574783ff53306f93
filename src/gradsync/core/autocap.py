"""``bucket_cap_mb="auto"``: choose the bucket cap from measured backwards.

Once the bucket order is final (re-planned after the first synced backward), the reducer traces
``MEASURED_SYNCS`` synced backwards: when each gradient became ready, and when each bucket's
collective was launched and finished. From them:

- a link model: a collective of ``b`` bytes takes ``latency + b * seconds_per_byte``, and
  collectives run one at a time in launch order (each starts when launched and the previous
  one is done), fit by least squares over the traced buckets;
- for every candidate cap, the buckets ``plan_buckets`` would build, each launched in index
  order once its last gradient is ready (median ready time over the traced backwards), and the
  time its last collective finishes under the link model.

The cap whose last collective is predicted to finish first wins; caps within ``TIE`` of the best
count as tied and the largest of them wins (fewer buckets: less per-bucket Python, which the
model does not see). Rank 0 decides and broadcasts, so every rank plans the same buckets.
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .buckets import MiB, plan_buckets

CANDIDATES_MB = (1.0, 2.0, 4.0, 8.0, 16.0, 25.0, 32.0, 64.0, 128.0)
MEASURED_SYNCS = 3
TIE = 0.02


@dataclass(frozen=True, kw_only=True)
class LinkModel:
    """A collective of ``b`` bytes takes ``latency + b * seconds_per_byte`` seconds."""

    latency: float
    seconds_per_byte: float

    def __post_init__(self):
        if self.latency < 0 or self.seconds_per_byte < 0:
            raise ValueError(f"link model terms must be non-negative, got {self}")

    def cost(self, nbytes: int) -> float:
        return self.latency + nbytes * self.seconds_per_byte


@dataclass(kw_only=True)
class BucketChoice:
    """What ``bucket_cap_mb="auto"`` chose and why (``model.bucket_choice``)."""

    bucket_cap_mb: float
    first_bucket_cap_mb: float
    link: LinkModel
    predicted_ms: dict[float, float] = field(default_factory=dict)  # cap -> predicted end of comm
    buckets: dict[float, int] = field(default_factory=dict)  # cap -> number of buckets

    def as_dict(self) -> dict:
        return {"bucket_cap_mb": self.bucket_cap_mb, "first_bucket_cap_mb": self.first_bucket_cap_mb,
                "latency_ms": 1e3 * self.link.latency,
                "gb_per_s": (1e-9 / self.link.seconds_per_byte) if self.link.seconds_per_byte else None,
                "predicted_ms": dict(self.predicted_ms), "buckets": dict(self.buckets)}


def fit_link(records: Sequence[dict]) -> LinkModel:
    """Fit the link model to traced buckets (``reducer.trace`` records, in launch order)."""
    sizes, spans = [], []
    for it in records:
        previous_done = None
        for b in sorted(it["buckets"], key=lambda b: b.get("launch", 0.0)):
            if not {"launch", "done"} <= b.keys():
                previous_done = None  # unknown finish: the next bucket's start is unknown too
                continue
            start = b["launch"] if previous_done is None else max(b["launch"], previous_done)
            previous_done = b["done"]
            if b["done"] > start:
                sizes.append(float(b["bytes"]))
                spans.append(b["done"] - start)
    if not spans:
        raise ValueError("no traced bucket has both a launch and a finish time")
    if len(set(sizes)) < 2:  # one size: no way to split latency from bandwidth; all of it per byte
        return LinkModel(latency=0.0, seconds_per_byte=statistics.median(s / b for s, b in zip(spans, sizes)
                                                                         if b > 0) if any(sizes) else 0.0)
    mean_b, mean_s = statistics.fmean(sizes), statistics.fmean(spans)
    var = sum((b - mean_b) ** 2 for b in sizes)
    slope = sum((b - mean_b) * (s - mean_s) for b, s in zip(sizes, spans)) / var
    if slope <= 0:  # time does not grow with size here: one bucket is best, latency is all
        return LinkModel(latency=mean_s, seconds_per_byte=0.0)
    intercept = mean_s - slope * mean_b
    if intercept < 0:  # refit through the origin rather than predict negative latency
        return LinkModel(latency=0.0, seconds_per_byte=sum(s * b for s, b in zip(spans, sizes))
                         / sum(b * b for b in sizes))
    return LinkModel(latency=intercept, seconds_per_byte=slope)


def ready_times(records: Sequence[dict], n: int) -> list[float]:
    """Median time (since backward start) at which each of ``n`` parameters' gradient was ready."""
    per_param: list[list[float]] = [[] for _ in range(n)]
    for it in records:
        for i, t in it.get("params", {}).items():
            per_param[i].append(t - it["backward_start"])
    return [statistics.median(ts) if ts else 0.0 for ts in per_param]


def predict_end(plan: list[list[int]], ready: Sequence[float], nbytes: Sequence[int], link: LinkModel) -> float:
    """When the last collective of ``plan`` finishes: launches in index order, one collective at a time."""
    launched = done = 0.0
    for members in plan:
        launched = max(launched, max(ready[i] for i in members))
        done = max(done, launched) + link.cost(sum(nbytes[i] for i in members))
    return done


def choose_cap(params: Sequence[torch.Tensor], order: Sequence[int] | None, ready: Sequence[float],
               link: LinkModel, first_bucket_cap_mb: float | None,
               candidates: Sequence[float] = CANDIDATES_MB) -> BucketChoice:
    """Return the candidate cap whose buckets are predicted to finish communicating first.

    ``first_bucket_cap_mb`` None: the first bucket gets torch's 1 MiB, or the cap if smaller.
    """
    nbytes = [p.numel() * p.element_size() for p in params]
    total_mb = sum(nbytes) / MiB
    # caps past the model's size all plan one bucket per dtype: keep the smallest such cap
    caps = sorted({c for c in candidates if c < total_mb} | {min([c for c in candidates if c >= total_mb]
                                                                 or [max(candidates)])})
    predicted, counts = {}, {}
    for cap in caps:
        first = min(1.0, cap) if first_bucket_cap_mb is None else first_bucket_cap_mb
        plan = plan_buckets(params, cap, first, order)
        predicted[cap] = predict_end(plan, ready, nbytes, link)
        counts[cap] = len(plan)
    best = min(predicted.values())
    cap = max(c for c, t in predicted.items() if t <= best * (1 + TIE))
    return BucketChoice(bucket_cap_mb=cap,
                        first_bucket_cap_mb=min(1.0, cap) if first_bucket_cap_mb is None else first_bucket_cap_mb,
                        link=link, predicted_ms={c: 1e3 * t for c, t in predicted.items()}, buckets=counts)


class AutoCaps:
    """The reducer's ``bucket_cap_mb="auto"`` state: trace, then choose once and re-plan."""

    def __init__(self, first_bucket_cap_mb: float | None):
        self.first_bucket_cap_mb = first_bucket_cap_mb  # the user's, or None for torch's default
        self.records: list[dict] = []
        self.measured = 0  # synced backwards since the order became final
        self.choice: BucketChoice | None = None
        self._own_trace = False

    def start(self, reducer) -> None:
        if reducer.trace is None:
            reducer.trace, self._own_trace = [], True

    def observe(self, reducer, record: dict | None, replanned: bool) -> None:
        """After a synced backward (``record`` None: not traced, e.g. shadowed by a joined rank):
        count it unless the layout changed in it; choose once ``MEASURED_SYNCS`` were counted.

        Every rank takes part in every synced backward (a joined one shadows it), so every rank
        reaches the choice, and its broadcast, at the same backward.
        """
        if replanned:  # it ran with the old layout: its buckets are not the ones to measure
            return
        self.measured += 1
        if record is not None:
            self.records.append(record)
        elif reducer.trace is None:  # switched off meanwhile: trace the next ones
            self._own_trace = False
            self.start(reducer)
        if self.measured < MEASURED_SYNCS:
            return
        if not self.records:  # this rank traced none (joined early): it proposes the current caps
            return self._agree(reducer, BucketChoice(bucket_cap_mb=reducer.bucket_cap_mb,
                                                     first_bucket_cap_mb=reducer.first_bucket_cap_mb,
                                                     link=LinkModel(latency=0.0, seconds_per_byte=0.0)))
        # every rank predicts from its own trace (what ``model.bucket_choice`` shows); rank 0's cap holds
        self._agree(reducer, choose_cap(reducer.params, reducer.plan_order,
                                        ready_times(self.records, len(reducer.params)),
                                        fit_link(self.records), self.first_bucket_cap_mb))

    def _agree(self, reducer, choice: BucketChoice) -> None:
        shared = torch.tensor([choice.bucket_cap_mb, choice.first_bucket_cap_mb], dtype=torch.float64,
                              device=reducer.device)
        if reducer.world_size > 1:
            reducer.wait(dist.broadcast(shared, src=dist.get_global_rank(reducer.group, 0), group=reducer.group,
                                        async_op=True), "the automatic bucket cap")
        choice.bucket_cap_mb, choice.first_bucket_cap_mb = shared.tolist()
        self.finish(reducer, choice)

    def resume(self, reducer, bucket_cap_mb: float, first_bucket_cap_mb: float) -> None:
        """Take the caps an interrupted run chose (from its gradient state); the caller re-plans."""
        self.choice = BucketChoice(bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb,
                                   link=LinkModel(latency=0.0, seconds_per_byte=0.0))
        self.records = []
        if self._own_trace:
            reducer.trace, self._own_trace = None, False
        reducer.bucket_cap_mb, reducer.first_bucket_cap_mb = bucket_cap_mb, first_bucket_cap_mb

    def finish(self, reducer, choice: BucketChoice) -> None:
        """Re-plan ``reducer``'s buckets with ``choice``; no more tracing for this."""
        self.resume(reducer, choice.bucket_cap_mb, choice.first_bucket_cap_mb)
        self.choice = choice
        order = reducer.plan_order or list(range(len(reducer.params) - 1, -1, -1))
        reducer.load_plan_order(order)


__all__ = ["AutoCaps", "BucketChoice", "CANDIDATES_MB", "LinkModel", "choose_cap", "fit_link", "predict_end", "ready_times"]
