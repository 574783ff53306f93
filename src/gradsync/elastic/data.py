"""Data that follows the membership: each window's global batch dealt across the current members.

``ElasticSampler`` draws one seeded order of the dataset per epoch. Each window takes the next
chunk of it (``global_batch`` samples, or ``steps x micro_batch`` per member) and deals its
micro-batches round-robin across the members of that window, in replica-id order. Every member
computes the same deal, so after a shrink or a join no sample is seen twice in an epoch and none
is skipped but the micro-batches a dead replica held in the window it died in (``lost``). With
``global_batch`` the members' micro-steps differ by at most one; the accumulator is told
(``acc.plan_window``) so a mean loss is averaged over every micro-batch of the window. A ``deterministic=True``
model gets contiguous blocks instead of the round-robin. ``state_dict()`` taken inside a window resumes at
the next micro-batch (with the accumulator's own ``state_dict()`` from the same moment).
"""
from __future__ import annotations

import numbers
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from .. import process
from ..deterministic import is_deterministic


def deal(chunk: list[int], micro_batch: int, members: list[int], blocks: bool = False) -> dict[int, list[list[int]]]:
    """Split ``chunk`` into micro-batches of ``micro_batch`` samples; micro-batch j goes to members[j % M], or
    with ``blocks`` (a ``deterministic=True`` model) in contiguous blocks, in member order, whose sizes differ
    by at most one (the first n % M members one more)."""
    micro = [chunk[i:i + micro_batch] for i in range(0, len(chunk), micro_batch)]
    if blocks:
        k, extra = divmod(len(micro), len(members))
        starts = [i * k + min(i, extra) for i in range(len(members) + 1)]
        return {m: micro[starts[i]:starts[i + 1]] for i, m in enumerate(members)}
    return {m: micro[i::len(members)] for i, m in enumerate(members)}


def _count(name: str, value: Any, least: int = 1) -> int:
    """``value`` as an int, refused unless an integer (not a bool) of at least ``least``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise ValueError(f"gradsync: ElasticSampler's {name} must be an integer >= {least}, got {value!r}")
    return int(value)


class ElasticSampler:
    """Yield this replica's micro-batches (lists of sample indices) window by window: ``sampler.iterate(acc)``.

    Exactly one of ``steps`` (micro-steps per member and window: the global batch grows and shrinks
    with the membership) and ``global_batch`` (samples per window, whatever the membership: a
    multiple of ``micro_batch``, with at least one micro-batch per member). A window larger than the dataset is
    refused (it would train on nothing)."""

    def __init__(self, num_samples: int, *, micro_batch: int, steps: int | None = None,
                 global_batch: int | None = None, seed: int = 0, epochs: int = 1):
        if (steps is None) == (global_batch is None):
            raise ValueError("gradsync: ElasticSampler takes steps= (micro-steps per member) or global_batch= "
                             "(samples per window), exactly one")
        self.num_samples, self.micro_batch = _count("num_samples", num_samples), _count("micro_batch", micro_batch)
        self.steps = None if steps is None else _count("steps", steps)
        self.global_batch = None if global_batch is None else _count("global_batch", global_batch)
        self.epochs = _count("epochs", epochs)
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise ValueError(f"gradsync: ElasticSampler's seed must be an integer, got {seed!r}")
        self.seed = int(seed)
        if self.global_batch is not None:
            if self.global_batch % self.micro_batch:
                raise ValueError(f"gradsync: global_batch={self.global_batch} must be a multiple of micro_batch="
                                 f"{self.micro_batch} (a window is dealt in whole micro-batches)")
            self._fits(self.global_batch)
        self.epoch, self.offset, self.windows, self.blocks = 0, 0, 0, False
        self.deals: dict[int, dict[int, list[list[int]]]] = {}  # the accumulator's window -> its deal (the last two)
        self.lost: list[tuple[int, int, list[int]]] = []  # (window, replica, samples) a dead replica held
        self.seen_generation = 0  # membership events up to this generation are in ``lost``
        self.dealt: tuple[int, int, list[int]] | None = None  # the last window dealt: (epoch, start, members)
        self.taken, self.mine = 0, 0  # of this replica's micro-batches in it: those yielded, all
        self.resume: dict[str, Any] | None = None  # a window load_state_dict() resumes inside

    def state_dict(self) -> dict[str, Any]:
        """The position in the epochs; inside a window (``taken`` of this replica's micro-batches yielded, not all),
        that window too, so that ``load_state_dict`` resumes at the next micro-batch."""
        inside = None
        if self.dealt is not None and self.taken < self.mine:
            epoch, start, members = self.dealt
            inside = {"epoch": epoch, "start": start, "members": list(members), "taken": self.taken}
        return {"epoch": self.epoch, "offset": self.offset, "windows": self.windows, "lost": list(self.lost),
                "seen_generation": self.seen_generation, "inside": inside}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.offset, self.windows = state["epoch"], state["offset"], state["windows"]
        self.lost = [tuple(x) for x in state["lost"]]
        self.seen_generation = state["seen_generation"]
        self.resume = state.get("inside")
        self.dealt, self.taken, self.mine = None, 0, 0

    def order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_samples, generator=g).tolist()

    def iterate(self, acc: Any) -> Iterator[list[int]]:
        # deterministic=True sums the window in the order of its micro-batches: in contiguous blocks, rank by rank
        # (with sync_each_batch, rank j % W runs it as its micro-step j // W: the round-robin deal)
        self.blocks = is_deterministic(getattr(acc, "model", None)) and not getattr(acc, "sync_each_batch", False)
        m = process.state.replica
        if m is not None:
            m.registered.setdefault("gradsync.ElasticSampler", self)  # a joiner takes the members' position
        if self.resume is not None:
            yield from self._resume(acc)
        while True:
            # the last window's losses first: a joiner admitted next takes this state, and it never saw that deal
            self._note_losses(m)
            acc.at_window_start()  # joins and admissions happen here, before the window is dealt
            if m is not None and m.stopping:  # the job agreed to stop here (gradsync.elastic.stopping)
                return
            members, me = _membership()
            self._note_losses(m)  # a member lost while admitting
            dealt = self._deal_next(members)
            if dealt is None:
                return
            counts = [len(v) for v in dealt.values()]
            if min(counts) != max(counts):
                _check_uneven(acc, counts)
            self.deals = {w: d for w, d in self.deals.items() if w >= acc.windows - 1}
            self.deals[acc.windows] = dealt  # acc.windows: the 0-based index of the window starting
            acc.plan_window(len(dealt[me]), sum(counts), max(counts))
            yield from self._take(dealt[me], 0)

    def _take(self, mine: list[list[int]], taken: int) -> Iterator[list[int]]:
        self.taken, self.mine = taken, len(mine)
        for batch in mine[taken:]:
            self.taken += 1  # counted before the yield: state_dict() after this micro-step resumes past it
            yield batch

    def _resume(self, acc: Any) -> Iterator[list[int]]:
        """The rest of the window a state_dict() was taken inside, dealt again to the same members."""
        inside, self.resume = self.resume, None
        members, me = _membership()
        if list(inside["members"]) != members:
            raise ValueError(f"gradsync: the ElasticSampler state was saved inside a window dealt to members "
                             f"{inside['members']}, but the members now are {members}; resume it with the same "
                             "members, or from a state saved between windows")
        if getattr(acc, "is_boundary", False):
            raise ValueError(f"gradsync: the ElasticSampler state was saved inside a window ({inside['taken']} of "
                             "this replica's micro-batches taken), but the accumulator is between windows; load "
                             "the accumulator's state_dict() saved with it (acc.load_state_dict) before iterating")
        dealt = self._deal_at(inside["epoch"], inside["start"], members)
        if inside["taken"] >= len(dealt[me]):
            raise ValueError(f"gradsync: the ElasticSampler state says {inside['taken']} micro-batches of this "
                             f"window were taken, but replica {me} was dealt {len(dealt[me])}: it was saved by "
                             "another rank; load each rank's own state_dict()")
        self.dealt = (inside["epoch"], inside["start"], members)
        self.deals[acc.windows - 1] = dealt  # the restored accumulator is inside this window already
        yield from self._take(dealt[me], inside["taken"])

    def _deal_at(self, epoch: int, start: int, members: list[int]) -> dict[int, list[list[int]]]:
        size = self.global_batch or self.steps * self.micro_batch * len(members)
        return deal(self.order(epoch)[start:start + size], self.micro_batch, members, self.blocks)

    def _fits(self, size: int) -> None:
        if size > self.num_samples:
            raise ValueError(f"gradsync: a window of ElasticSampler takes {size} samples but the dataset has only "
                             f"{self.num_samples} samples, so it would train on nothing; lower "
                             f"{'global_batch' if self.global_batch else 'steps or micro_batch'}")

    def _deal_next(self, members: list[int]) -> dict[int, list[list[int]]] | None:
        """Deal the next window across ``members`` and advance; None at the end of the last epoch."""
        size = self.global_batch or self.steps * self.micro_batch * len(members)
        if size < self.micro_batch * len(members):
            raise ValueError(f"gradsync: global_batch={size} gives some of the {len(members)} members no "
                             f"micro-batch of {self.micro_batch}; raise global_batch")
        self._fits(size)
        if self.offset + size > self.num_samples:  # the epoch's remainder is dropped
            self.epoch, self.offset = self.epoch + 1, 0
            if self.epoch >= self.epochs:
                return None
        dealt = self._deal_at(self.epoch, self.offset, members)
        self.dealt = (self.epoch, self.offset, members)
        self.offset += size
        self.windows += 1
        return dealt

    def replay(self, events: list[Any], members: list[int]) -> Iterator[tuple[int, list[list[int]], list[tuple]]]:
        """Deal a whole run again from its first ``members`` and its membership ``events`` (records or
        their dicts), on a fresh sampler: yield (window, the micro-batches kept, [(replica, samples) lost]),
        what one process trains on to reproduce the run."""
        rows = [e if isinstance(e, dict) else vars(e) for e in events]
        current, window = set(members), 0
        while True:
            current |= {r for e in rows if e["window"] == window for r in e["joined"]}  # joins come before the deal
            dealt = self._deal_next(sorted(current))
            if dealt is None:
                return
            gone = {r for e in rows if e["window"] == window for r in e["left"]}
            yield (window, [mb for r, mbs in dealt.items() if r not in gone for mb in mbs],
                   [(r, [i for mb in dealt[r] for i in mb]) for r in sorted(gone)])
            current, window = current - gone, window + 1

    def _note_losses(self, m: Any) -> None:
        """The replicas that left in a window lost the micro-batches dealt to them there and not synced."""
        if m is None:
            return
        for event in m.events:
            if event.generation > self.seen_generation and event.left:
                dealt = self.deals.get(event.window, {})
                self.lost += [(event.window, r, [i for mb in dealt.get(r, [])[event.committed:] for i in mb])
                              for r in event.left]
        self.seen_generation = max([e.generation for e in m.events], default=self.seen_generation)


def _check_uneven(acc: Any, counts: list[int]) -> None:
    """Refuse, on every rank alike, what cannot run with members' micro-step counts differing by one."""
    if getattr(acc, "sync_each_batch", False):
        raise ValueError(f"gradsync: sync_each_batch=True needs every member to run the same number of micro-steps "
                         f"(each one synchronizes), but this window's micro-batches were dealt {counts}; use steps=, "
                         "or a global_batch whose micro-batches divide evenly among the members")
    model = getattr(acc, "model", None)
    will = getattr(model, "will_broadcast_buffers", None)  # gradsync's, also when built by torch's name
    if will is not None:
        broadcasts = will() and next(model.module.buffers(), None) is not None
    else:
        broadcasts = isinstance(model, torch.nn.parallel.DistributedDataParallel) and model.will_sync_module_buffers()
    if broadcasts:
        raise ValueError(f"gradsync: this window's micro-batches were dealt {counts}, but the model broadcasts "
                         "its buffers at every forward, a collective that would pair with a different one on "
                         "the members with fewer micro-steps; construct the model with forward_sync_buffers=False "
                         "(broadcast_buffers=False before torch 2.13), or use steps= or a global_batch whose micro-batches divide evenly among the members")


def _membership() -> tuple[list[int], int]:
    """The current members and this replica's id (elastic), else the ranks of the default group."""
    m = process.state.replica
    if m is not None:
        return list(m.members), m.replica_id
    if dist.is_initialized():
        return list(range(dist.get_world_size())), dist.get_rank()
    return [0], 0


__all__ = ["ElasticSampler", "deal"]
