"""Data that follows the membership: each window's global batch dealt across the current members.

``ElasticSampler`` draws one seeded order of the dataset per epoch. Each window takes the next
chunk of it (``global_batch`` samples, or ``steps x micro_batch`` per member) and deals its
micro-batches round-robin across the members of that window, in replica-id order. Every member
computes the same deal, so after a shrink or a join no sample is seen twice in an epoch and none
is skipped but the micro-batches a dead replica held in the window it died in (``lost``). With
``global_batch`` the members' micro-steps differ by at most one; the accumulator is told
(``acc.plan_window``) so a mean loss is averaged over every micro-batch of the window.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from .. import process
from ..deterministic import is_deterministic


def deal(chunk: list[int], micro_batch: int, members: list[int], blocks: bool = False) -> dict[int, list[list[int]]]:
    """Split ``chunk`` into micro-batches of ``micro_batch`` samples; micro-batch j goes to members[j % M], or
    with ``blocks`` (a ``deterministic=True`` model) to members[j // k], k = ceil(micro-batches / M)."""
    micro = [chunk[i:i + micro_batch] for i in range(0, len(chunk), micro_batch)]
    if blocks:
        k = -(-len(micro) // len(members))
        return {m: micro[i * k:(i + 1) * k] for i, m in enumerate(members)}
    return {m: micro[i::len(members)] for i, m in enumerate(members)}


class ElasticSampler:
    """Yield this replica's micro-batches (lists of sample indices) window by window: ``sampler.iterate(acc)``.

    Exactly one of ``steps`` (micro-steps per member and window: the global batch grows and shrinks
    with the membership) and ``global_batch`` (samples per window, whatever the membership: a
    multiple of ``micro_batch``, with at least one micro-batch per member)."""

    def __init__(self, num_samples: int, *, micro_batch: int, steps: int | None = None,
                 global_batch: int | None = None, seed: int = 0, epochs: int = 1):
        if (steps is None) == (global_batch is None):
            raise ValueError("gradsync: ElasticSampler takes steps= (micro-steps per member) or global_batch= "
                             "(samples per window), exactly one")
        if micro_batch < 1 or (steps is not None and steps < 1) or epochs < 1:
            raise ValueError("gradsync: ElasticSampler needs micro_batch, steps and epochs of at least 1")
        if global_batch is not None and (global_batch < micro_batch or global_batch % micro_batch):
            raise ValueError(f"gradsync: global_batch={global_batch} must be a multiple of micro_batch={micro_batch}")
        self.num_samples, self.micro_batch, self.steps = int(num_samples), int(micro_batch), steps
        self.global_batch, self.seed, self.epochs = global_batch, int(seed), int(epochs)
        self.epoch, self.offset, self.windows, self.blocks = 0, 0, 0, False
        self.deals: dict[int, dict[int, list[list[int]]]] = {}  # the accumulator's window -> its deal (the last two)
        self.lost: list[tuple[int, int, list[int]]] = []  # (window, replica, samples) a dead replica held
        self.seen_generation = 0  # membership events up to this generation are in ``lost``

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset, "windows": self.windows, "lost": list(self.lost),
                "seen_generation": self.seen_generation}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.offset, self.windows = state["epoch"], state["offset"], state["windows"]
        self.lost = [tuple(x) for x in state["lost"]]
        self.seen_generation = state["seen_generation"]

    def order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_samples, generator=g).tolist()

    def iterate(self, acc: Any) -> Iterator[list[int]]:
        # deterministic=True sums the window in the order of its micro-batches: rank j // k runs micro-batch j
        # (with sync_each_batch, rank j % W runs it as its micro-step j // W: the round-robin deal)
        self.blocks = is_deterministic(getattr(acc, "model", None)) and not getattr(acc, "sync_each_batch", False)
        m = process.state.replica
        if m is not None:
            m.registered.setdefault("gradsync.ElasticSampler", self)  # a joiner takes the members' position
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
            self.deals = {w: d for w, d in self.deals.items() if w >= acc.windows - 1}
            self.deals[acc.windows] = dealt  # acc.windows: the 0-based index of the window starting
            mine = dealt[me]
            acc.plan_window(len(mine), sum(len(v) for v in dealt.values()), max(len(v) for v in dealt.values()))
            yield from mine

    def _deal_next(self, members: list[int]) -> dict[int, list[list[int]]] | None:
        """Deal the next window across ``members`` and advance; None at the end of the last epoch."""
        size = self.global_batch or self.steps * self.micro_batch * len(members)
        if size < self.micro_batch * len(members):
            raise ValueError(f"gradsync: global_batch={size} gives some of the {len(members)} members no "
                             f"micro-batch of {self.micro_batch}; raise global_batch")
        if self.offset + size > self.num_samples:  # the epoch's remainder is dropped
            self.epoch, self.offset = self.epoch + 1, 0
            if self.epoch >= self.epochs or size > self.num_samples:
                return None
        dealt = deal(self.order(self.epoch)[self.offset:self.offset + size], self.micro_batch, members, self.blocks)
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


def _membership() -> tuple[list[int], int]:
    """The current members and this replica's id (elastic), else the ranks of the default group."""
    m = process.state.replica
    if m is not None:
        return list(m.members), m.replica_id
    if dist.is_initialized():
        return list(range(dist.get_world_size())), dist.get_rank()
    return [0], 0


__all__ = ["ElasticSampler", "deal"]
