"""``check_replicas=True``: every synced backward compares what every rank must hold bit for bit.

Data parallelism rests on one invariant: after each optimizer step every replica holds the same
parameters, and after each synced backward the same reduced gradient. A silent fault (a flipped bit
in memory, on a link, in the optimizer's state) breaks it without a NaN, and the replicas then part
ways for good. Each rank fingerprints, per bucket, its parameters as the previous optimizer step left
them and the reduced gradient of the previous synced backward (known only once the buckets' results
are in, after this control left), and writes them into its own slots of the end-of-backward control
(``control.py``): no collective of its own, 16 bytes per bucket per rank. A mismatch raises
``ReplicaMismatchError`` on every rank, naming the ranks that disagree with the majority (with two,
both), the buckets and, after one more exchange made only then, the parameters.

A fingerprint is the wrapped sum of a tensor's bits read as 64-bit words: integer addition is exact
and order-free, so equal tensors give equal sums on every rank and device, and one flipped bit moves
the sum by a power of two below 2**64, which no wrap cancels. It is computed where the data is (a
reduction on the GPU for GPU tensors); only the 8-byte sums travel.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .errors import PeerFailure, ReplicaMismatchError

BIG = 1 << 16  # words: a tensor this large is summed alone, smaller ones after one concatenation


def words(t: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, bool]:
    """``t``'s bits as (int64 words from its first byte, or None; its last bytes that do not fill a word, or
    None; whether both view ``t``'s memory, rather than a copy)."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)  # a strided slice: a copy, not live
    live = flat.storage_offset() % 8 == 0 and flat.data_ptr() == t.data_ptr()
    if not live:  # int64 views need 8-byte aligned memory: a copy starts aligned
        flat = flat.clone()
    body = flat.numel() // 8 * 8
    return (flat[:body].view(torch.int64) if body else None), (flat[body:] if body < flat.numel() else None), live


def fingerprint(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The wrapped int64 sum of every word of ``tensors`` (a 0-d tensor on their device)."""
    found = [words(t)[:2] for t in tensors]
    device = tensors[0].device if tensors else None
    return summed([b for b, _ in found if b is not None], [e for _, e in found if e is not None], device)


def summed(bodies: list[torch.Tensor], edges: list[torch.Tensor], device: torch.device | None) -> torch.Tensor:
    """The wrapped sum of ``bodies`` (int64 words) and ``edges`` (bytes), on ``device`` when both are empty."""
    parts, small = [], []
    for body in bodies:
        (parts if body.numel() >= BIG else small).append(body)
    if small:
        parts.append(torch.cat(small))
    if edges:  # a byte widened to a word: a flipped bit still moves the sum by a power of two
        parts.append(torch.cat(edges).to(torch.int64))
    if not parts:
        return torch.zeros((), dtype=torch.int64, device=device)
    return torch.stack([p.sum() for p in parts]).sum()


class ReplicaCheck:
    """The control's fingerprint slots for one reducer: ``1 + 4 x buckets`` int32 per rank
    ([what is present: 1 the gradient's, 2 the parameters' | parameters' int64 per bucket | previous reduced
    gradient's int64 per bucket]).

    With the data on a GPU and the control on the CPU, reading the fingerprints back at once would stall the
    host on the device every synced backward; they are copied back without waiting instead and travel in the
    next synced backward's control (``lag`` 1), by when the copy has long finished.
    """

    def __init__(self, store: Any, names: Sequence[str], mode: bool | str = True):
        self.store, self.names, self.evict = store, list(names), mode == "evict"
        self.grads: torch.Tensor | None = None  # the previous synced backward's, per bucket
        self.views: dict[int, tuple[int, torch.Tensor | None, torch.Tensor | None]] = {}  # i -> (data_ptr, words)
        self.arrivals: dict[int, torch.Tensor] = {}  # bucket index -> its result's fingerprint, this synced backward
        self.copied: tuple[torch.Tensor, Any] | None = None  # lag 1: the last control's slots on the host, their event
        self.lag = 0

    def slots(self) -> int:
        return 1 + 4 * len(self.store.buckets)

    def outgoing(self, device: torch.device) -> torch.Tensor:
        """This rank's slots for the control about to launch: the parameters now, the gradient before (off
        the device, those of the previous control)."""
        buckets, self.arrivals = self.store.buckets, {}
        grads, present = self.grads, self.grads is not None and self.grads.numel() == len(buckets)
        mine = torch.stack([self.of_params(b.members) for b in buckets])
        body = torch.cat([mine, grads if present else torch.zeros_like(mine)])
        flags = torch.full((1,), 2 + int(present), dtype=torch.int64, device=body.device)  # no copy from the host
        slots = torch.cat([flags, body])
        self.lag = int(slots.device.type == "cuda" and device.type == "cpu")
        if not self.lag:
            slots = slots.to(device)
        else:
            ready, self.copied = self.copied, (slots.to(device, non_blocking=True), torch.cuda.Event())
            self.copied[1].record()
            if ready is None or ready[0].numel() != slots.numel():  # the first control, or the buckets changed
                return torch.zeros(self.slots(), dtype=torch.int32, device=device)
            ready[1].synchronize()  # recorded a synced backward ago: done unless the host runs that far ahead
            slots = ready[0]
        return torch.cat([slots[:1].to(torch.int32), slots[1:].view(torch.int32)])

    def of_params(self, members: Sequence[int]) -> torch.Tensor:
        """The fingerprint of these parameters, from word views kept while their memory stays the same."""
        params, views, bodies, edges = self.store.params, self.views, [], []
        for i in members:
            seen = views.get(i)
            if seen is None or seen[0] != params[i].data_ptr():
                body, edge, live = words(params[i])
                seen = (params[i].data_ptr() if live else -1, body, edge)
                views[i] = seen
            if seen[1] is not None:
                bodies.append(seen[1])
            if seen[2] is not None:
                edges.append(seen[2])
        return summed(bodies, edges, params[members[0]].device if members else None)

    def arrived(self, index: int, result: torch.Tensor) -> None:
        """Bucket ``index``'s reduction is in: fingerprint it now, while later buckets still travel."""
        if not self.store.sharded:  # each rank holds its own shard: nothing every rank must share
            self.arrivals[index] = fingerprint([result])

    def reduced(self, results: Sequence[torch.Tensor] | None) -> None:
        """The synced backward's results are in (None: written back already): keep their fingerprints (those
        not fingerprinted on arrival, e.g. a bucket skip_all_reduce_unused_params did not launch, now)."""
        if self.store.sharded:
            return
        tensors = results if results is not None else [b.buffer for b in self.store.buckets]
        self.grads = torch.stack([self.arrivals.get(k) if k in self.arrivals else fingerprint([t])
                                  for k, t in enumerate(tensors)])

    def reduced_late(self, index: int) -> None:
        """Bucket ``index`` was reduced after the control (skip_all_reduce_unused_params): its fingerprint is its
        result's, taken on arrival, not that of the unreduced buffer ``reduced`` saw."""
        if self.grads is not None and index in self.arrivals:
            self.grads[index] = self.arrivals[index]

    def forget(self) -> None:
        """The group changed (elastic re-formation): the next control carries no previous gradient."""
        self.grads = self.copied = None

    def check(self, slots: torch.Tensor, active: Sequence[int], sync: int, plane: Any) -> None:
        """Raise ``ReplicaMismatchError`` on every rank unless the active ranks' fingerprints agree."""
        b = len(self.store.buckets)
        rows = {r: slots[r] for r in active}
        params = {r: row[1:1 + 2 * b].clone().view(torch.int64).tolist() for r, row in rows.items() if int(row[0]) & 2}
        grads = {r: row[1 + 2 * b:].clone().view(torch.int64).tolist() for r, row in rows.items() if int(row[0]) & 1}
        bad_params, odd = disagreeing(params, b) if len(params) == len(rows) else ([], set())
        bad_grads, odd_grads = disagreeing(grads, b) if len(grads) == len(rows) else ([], set())
        if not bad_params and not bad_grads:
            return
        ranks = sorted(odd | odd_grads)
        names = self.name_parameters(bad_params, active, plane) if bad_params else []
        text = mismatch_text(ranks, list(active), sync, bad_params, bad_grads, names, self.lag)
        text += in_the_job(ranks, plane.group)
        if self.evict and plane.protocol is not None and 2 * len(ranks) < len(active):
            if plane.rank not in ranks:  # the majority re-forms without the minority and reduces the window again
                raise PeerFailure(f"gradsync: synced backward {sync}: {who(ranks, list(active))}: evicting them "
                                  "(check_replicas=\"evict\")")
            text += (" check_replicas=\"evict\": this replica leaves the job, the others go on without its window; "
                     "its launcher restarts it and it rejoins with a peer's state.")
        raise ReplicaMismatchError(text)

    def name_parameters(self, buckets: list[int], active: Sequence[int], plane: Any) -> list[str]:
        """One more exchange, made only after a mismatch: which parameters of ``buckets`` differ."""
        members = [i for k in buckets for i in self.store.buckets[k].members]
        params = self.store.params
        rows = gathered(torch.stack([fingerprint([params[i]]) for i in members]), plane, "the parameters' fingerprints")
        by_rank = {r: rows[r].tolist() for r in active}
        return [self.names[members[j]] for j in disagreeing(by_rank, len(members))[0]]


def in_the_job(ranks: list[int], group: Any) -> str:
    """The global ranks of ``group``'s ``ranks``, where they differ: the host to check is the job's rank."""
    glob = [dist.get_global_rank(group, r) for r in ranks] if dist.is_initialized() else ranks
    return "" if glob == ranks else (f" The ranks above are positions in the model's process group: in the job they "
                                     f"are global rank(s) {glob}.")


def gathered(mine: torch.Tensor, plane: Any, what: str) -> torch.Tensor:
    """Every rank's int64 ``mine``, one row per rank: an all-reduce of a table whose rows only their rank fills."""
    w, m = plane.world_size, 2 * mine.numel()
    table = torch.zeros(w * m, dtype=torch.int32, device=plane.device)
    table[plane.rank * m:(plane.rank + 1) * m] = mine.view(torch.int32).to(plane.device)
    plane.wait(dist.all_reduce(table, group=plane.group, async_op=True), what)
    return table.cpu().view(w, m).contiguous().view(torch.int64)


def disagreeing(values: dict[int, list[int]], n: int) -> tuple[list[int], set[int]]:
    """The indices where the ranks' values differ, and the ranks outside each index's strict majority
    (every rank of an index without one)."""
    where, ranks = [], set()
    for k in range(n):
        seen = Counter(v[k] for v in values.values())
        if len(seen) > 1:
            where.append(k)
            value, count = seen.most_common(1)[0]
            ranks |= {r for r, v in values.items() if v[k] != value or 2 * count <= len(values)}
    return where, ranks


def who(ranks: list[int], active: list[int]) -> str:
    return (f"rank(s) {ranks} disagree with the majority of ranks {active}" if 2 * len(ranks) < len(active)
            else f"ranks {ranks} disagree and no majority can tell which is right")


def mismatch_text(ranks: list[int], active: list[int], sync: int, params: list[int], grads: list[int],
                  names: list[str], lag: int = 0) -> str:
    what = []
    if params:
        shown = ", ".join(f"'{n}'" for n in names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        when = "the last optimizer step" if not lag else f"the optimizer step before synced backward {sync - lag}"
        what.append(f"their parameters differ (bucket(s) {params}: {shown}) as {when} left them")
    if grads:
        what.append(f"their reduced gradients of synced backward {sync - 1 - lag} differ (bucket(s) {grads})")
    return (f"gradsync: the replicas stopped agreeing at synced backward {sync}: {who(ranks, active)}: {'; '.join(what)}. Every "
            "replica must hold the same bits; a silent fault (a flipped bit in memory, on a link or in the optimizer's "
            "state) broke that, and training on would let them drift apart for good. No gradient of this synced "
            "backward was written back (with overlap_optimizer, its buckets already stepped). "
            "Check or replace the named rank's host (a memory test of its GPU or RAM), then resume every rank from "
            f"a checkpoint saved before synced backward {max(sync - 2 - lag, 0)}.")


__all__ = ["ReplicaCheck", "disagreeing", "fingerprint", "gathered", "in_the_job", "mismatch_text", "summed", "who", "words"]
