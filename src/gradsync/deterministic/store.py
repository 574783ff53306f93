"""The window of ``deterministic=True``: each micro-step's gradient kept apart, summed in a fixed tree.

Autograd adds each micro-step's gradient into ``.grad`` in arrival order, ((g0 + g1) + g2) + g3, a
chain whose bits depend on how many micro-steps a rank runs. Here every gradient a backward produces
goes into its parameter's ``TreeSum`` and ``.grad`` is released, so the next backward's gradient
arrives alone; the synced backward copies the tree's total into the bucket. The price is the tree's
nodes: at most log2(k) + 1 gradient copies for k micro-steps, and ``.grad`` reads None inside a window
(it holds the average again after the synced backward).
"""
from __future__ import annotations

import weakref
from typing import Any

import torch

from .._torch import stamp, unchanged
from ..engine.checks import check_grad
from ..engine.store import BucketStore
from .tree import TreeSum


class TreeStore(BucketStore):
    """A bucket store whose window is a ``TreeSum`` per parameter, apart from the buckets (with gradient
    views only the average written back is the bucket's slot)."""

    copies_per_bucket = property(lambda self: False)  # each gradient as it is ready: it joins its tree
    keeps_local_per_grad = property(lambda self: True)
    adopts_views = property(lambda self: False)
    keeps_local_grads = property(lambda self: True)  # the trees are apart from the buckets

    def __init__(self, params: list[torch.Tensor], names: list[str], **kwargs: Any):
        super().__init__(params, names, **kwargs)
        self.forget_trees()
        self.reductions: list[TreeSum] | None = None  # sync_each_batch: the window's reduced micro-steps
        self.handles: list[Any] = []

    def keep_reductions_apart(self) -> None:
        """``sync_each_batch``: each micro-step's reduction (a block of W leaves of the window's tree, summed in
        rank order) is the next leaf of a tree of reductions, whose total ``.grad`` holds. Before the next
        gradient is accumulated ``.grad`` is emptied again, so each micro-step reduces its own gradient alone."""
        self.reductions = [TreeSum() for _ in self.params]
        self.written: list[tuple[Any, int] | None] = [None] * len(self.params)  # stamp() of the total put in .grad
        self.fired = [False] * len(self.params)  # before_accumulate ran in this micro-step (not: an unused parameter)
        me = weakref.ref(self)
        self.handles = [p.register_hook(_before_accumulate(me, i)) for i, p in enumerate(self.params)]

    def before_accumulate(self, i: int) -> None:
        """A gradient of parameter ``i`` is about to be accumulated into ``.grad``."""
        p, written, self.fired[i] = self.params[i], self.written[i], True
        if unchanged(written, p.grad):
            p.grad = None  # the window's total so far: it stays in the tree of reductions
        else:  # .grad emptied or replaced since (zero_grad): a new window
            self.reductions[i] = TreeSum()

    def forget_trees(self) -> None:
        self.trees = [TreeSum() for _ in self.params]

    def keep_local(self, i: int) -> None:
        """This backward's gradient of parameter ``i`` is final: the next leaf of its tree."""
        grad = self.params[i].grad
        if grad is not None:
            check_grad(grad, self.views[i], self.names[i])
            leaf = grad.detach()
            self.trees[i].push(leaf.clone() if self.grad_as_view and self._is_slot(i, grad) else leaf)  # not the bucket
            self.params[i].grad = None

    def copy_in(self, i: int, divide: bool) -> None:
        """Put the window's tree total into the slot (divided by a power-of-two world size: exact). The
        tree stays until the reduction is written back: a commit protocol may reduce the window again."""
        if self.reductions is not None:
            if not self.fired[i]:  # no gradient of this rank's in this micro-step: what its arrival would have done
                self.before_accumulate(i)
            self.fired[i] = False
        grad = self.params[i].grad  # the window's only leaf when the tree is empty: it stays, apart from the bucket
        if self.trees[i] or (grad is not None and self.grad_as_view and self._is_slot(i, grad)):
            self.keep_local(i)
        total, view = self.trees[i].total() if self.trees[i] else self.params[i].grad, self.views[i]
        if total is not None and not self.trees[i]:  # autograd's own tensor, unchecked so far
            check_grad(total, view, self.names[i])
        if total is None:
            view.zero_()
        elif divide:
            torch.div(total, self.world_size, out=view)
        else:
            view.copy_(total)

    def end_sync(self, results: list[Any] | None, counts: list[int], done: Any = None) -> None:
        super().end_sync(results, counts, self._totals_first(counts, done))
        self.forget_trees()  # the window is reduced and written back
        if self.reductions is not None and done is None:
            self._totals(range(len(self.params)), counts)

    def write_back_as_reduced(self, launcher: Any, everyone: list[int], check: Any, done: Any) -> None:
        super().write_back_as_reduced(launcher, everyone, check, self._totals_first(everyone, done))

    def _totals_first(self, counts: list[int], done: Any) -> Any:
        """overlap_optimizer's ``done(members)``, after those parameters' ``.grad`` became the window's total."""
        if done is None or self.reductions is None:
            return done

        def totals_then_done(members: list[int]) -> None:
            self._totals(members, counts)
            done(members)
        return totals_then_done

    def _totals(self, members: Any, counts: list[int]) -> None:
        """``sync_each_batch``: this micro-step's reduction joins the tree of reductions; ``.grad`` is its total."""
        for i in members:
            p = self.params[i]
            if counts[i] and p.grad is not None:
                self.reductions[i].push(p.grad.detach().clone())
            if self.reductions[i]:
                p.grad = self.reductions[i].total().clone()
                self.written[i] = stamp(p.grad)

    def release(self) -> None:
        super().release()
        for h in self.handles:
            h.remove()
        self.handles = []

    def drop_local(self) -> None:
        super().drop_local()
        self.forget_trees()

    def has_local_grad(self, i: int) -> bool:
        return bool(self.trees[i]) or self.params[i].grad is not None

    def grad_tensors(self) -> list[torch.Tensor]:
        return super().grad_tensors() + [t for tree in self.trees for t in tree.tensors()]

    def tree_state(self) -> dict[str, list[tuple[int, torch.Tensor]]]:
        """The window's trees by parameter name: (height, partial sum) nodes (``grad_state_dict``); with
        ``sync_each_batch``, the trees of reductions under ``"<name> reductions"``."""
        state = {self.names[i]: _nodes(tree) for i, tree in enumerate(self.trees) if tree}
        for i, tree in enumerate(self.reductions or ()):
            if tree and self.params[i].grad is not None:
                state[f"{self.names[i]} reductions"] = _nodes(tree)
        return state

    def load_tree_state(self, state: dict[str, list[tuple[int, torch.Tensor]]]) -> None:
        self.forget_trees()
        for i, name in enumerate(self.names):
            device = self.params[i].device
            self.trees[i].nodes = [(h, t.detach().clone().to(device)) for h, t in state.get(name, ())]
            if f"{name} reductions" in state:
                if self.reductions is None:
                    raise ValueError("gradsync: this gradient state was saved inside a sync_each_batch window; load it "
                                     "after building the GradientAccumulator(sync_each_batch=True)")
                self.reductions[i].nodes = [(h, t.detach().clone().to(device)) for h, t in state[f"{name} reductions"]]
                grad = self.params[i].grad  # the total, loaded as .grad: the next gradient empties it again
                self.written[i] = None if grad is None else stamp(grad)


def _nodes(tree: TreeSum) -> list[tuple[int, torch.Tensor]]:
    return [(h, t.detach().clone()) for h, t in tree.nodes]


def _before_accumulate(store: weakref.ref, i: int) -> Any:
    def hook(grad: torch.Tensor) -> None:
        me = store()
        if me is not None and me.handles:
            me.before_accumulate(i)
    return hook


__all__ = ["TreeStore"]
