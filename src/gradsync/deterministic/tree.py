"""One fixed binary tree over a sequence of tensors, built as they arrive.

``TreeSum`` is a binary counter: a new leaf merges with the latest node while the two are the same
height, so leaves 0..3 give ((0 + 1) + (2 + 3)); what is left at the end folds from the right. A
sequence cut into blocks of 2^a leaves, each summed by its own ``TreeSum``, and those sums fed in order
to another ``TreeSum`` gives the same nodes in the same order as one ``TreeSum`` over every leaf: every
merge below height a happens inside a block, every merge above it between whole blocks, and the final
fold sees the same nodes. So a rank's micro-steps and the ranks' sums make the same tree as one
process over the whole window, bit for bit.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch


class TreeSum:
    """Sum tensors pushed one at a time, in a fixed binary tree over their positions."""

    __slots__ = ("nodes",)

    def __init__(self) -> None:
        self.nodes: list[tuple[int, torch.Tensor]] = []  # (height, partial sum); heights strictly decrease

    def push(self, leaf: torch.Tensor) -> None:
        """Add the next leaf (taken over: merges write into the left node, which this sum owns)."""
        height, node = 0, leaf
        while self.nodes and self.nodes[-1][0] == height:
            _, left = self.nodes.pop()
            node, height = left.add_(node), height + 1  # left + node: the same bits as node + left
        self.nodes.append((height, node))

    def total(self) -> torch.Tensor | None:
        """The sum so far, without changing the nodes (None before the first leaf)."""
        if not self.nodes:
            return None
        node = self.nodes[-1][1]
        for _, left in reversed(self.nodes[:-1]):
            node = left + node
        return node

    def tensors(self) -> list[torch.Tensor]:
        return [node for _, node in self.nodes]

    def __bool__(self) -> bool:
        return bool(self.nodes)


def tree_sum(leaves: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """The ``TreeSum`` of ``leaves``, which are not modified."""
    tree = TreeSum()
    for leaf in leaves:
        tree.push(leaf.clone())
    return tree.total()


__all__ = ["TreeSum", "tree_sum"]
