"""The link model behind ``bucket_cap_mb="auto"`` where the link bounds the step (``autocap.py``).

The all-reduces already timed (each bucket's launch, done and bytes) give latency + bytes / bandwidth
(``fit_link``); the finest candidate's gradient-ready times give when each bucket of any layout is ready
(``param_ready``), and so when communication of a layout would end (``predict_end``).
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence

def fit_link(records: Sequence[dict]) -> tuple[float, float] | None:
    """Fit the link as ``latency`` per collective + ``bytes / bandwidth`` to traced synced backwards.

    gloo runs several buckets' collectives at once, sharing the link, so one bucket's launch-to-done
    says little; a busy period (launch-to-done intervals that overlap, merged) is what the link
    spent on all its buckets: its length = count x latency + bytes / bandwidth, fitted by least
    squares over the busy periods of ``records``. Returns (latency s, bandwidth bytes/s), or None
    when nothing was traced; (0, bytes / time) when the periods cannot tell latency from bandwidth.
    """
    periods = []  # (collectives, bytes, seconds)
    for record in records:
        spans = sorted((b["launch"], b["done"], float(b["bytes"])) for b in record["buckets"]
                       if "launch" in b and "done" in b)
        current = None
        for launch, done, size in spans:
            if current is not None and launch <= current[1]:
                current = [current[0], max(current[1], done), current[2] + 1, current[3] + size]
            else:
                if current is not None:
                    periods.append((current[2], current[3], current[1] - current[0]))
                current = [launch, done, 1, size]
        if current is not None:
            periods.append((current[2], current[3], current[1] - current[0]))
    periods = [p for p in periods if p[2] > 0]
    if not periods:
        return None
    scc = sum(c * c for c, _, _ in periods)
    scx = sum(c * x for c, x, _ in periods)
    sxx = sum(x * x for _, x, _ in periods)
    scd = sum(c * d for c, _, d in periods)
    sxd = sum(x * d for _, x, d in periods)
    det = scc * sxx - scx * scx
    if det > 1e-9 * scc * sxx:
        latency, per_byte = (scd * sxx - sxd * scx) / det, (scc * sxd - scx * scd) / det
        if latency >= 0 and per_byte > 0:
            return latency, 1.0 / per_byte
    return 0.0, sum(x for _, x, _ in periods) / sum(d for _, _, d in periods)


def param_ready(records: Sequence[dict], layout: list[list[int]], n: int) -> list[float] | None:
    """Each parameter's gradient-ready time (s after the backward's first gradient), from traces of
    ``layout``: the median over ``records`` of its bucket's ready time (an upper bound for each member)."""
    per_bucket: list[list[float]] = [[] for _ in layout]
    for record in records:
        for b in record["buckets"]:
            if "ready" in b and b["index"] < len(layout):
                per_bucket[b["index"]].append(b["ready"] - record["backward_start"])
    if not records or any(not t for t in per_bucket):
        return None
    ready = [0.0] * n
    for members, times in zip(layout, per_bucket):
        for i in members:
            ready[i] = statistics.median(times)
    return ready


def predict_end(layout: list[list[int]], ready: Sequence[float], nbytes: Sequence[float], latency: float,
                bandwidth: float) -> float:
    """When the last bucket's collective ends (s after the first gradient) with ``layout``: buckets
    launch in index order once all their gradients are ready, and take the link one after another."""
    launched = done = 0.0
    for members in layout:
        launched = max(launched, max(ready[i] for i in members))
        done = max(done, launched) + latency + sum(nbytes[i] for i in members) / bandwidth
    return done


__all__ = ["fit_link", "param_ready", "predict_end"]
