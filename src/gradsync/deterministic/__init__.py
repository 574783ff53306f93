"""``DistributedDataParallel(deterministic=True)``: the same gradient bits whatever the world size.

A window's global micro-batch j runs on rank j // k as its micro-step j % k (k micro-steps per rank); with
``GradientAccumulator(sync_each_batch=True)``, on rank j % W as its micro-step j // W.
Its gradient is summed in one fixed binary tree over j: each rank sums its k micro-steps' gradients in
that tree's order (``store.py``: a complete subtree when k is a power of two), and the ranks' sums meet
in rank order (``launcher.py``: all-to-all of each bucket's chunks, the chunk's parts summed in the
tree's order, all-gather: the bytes of a ring all-reduce). Dividing by a power-of-two world size and
scaling a loss by a power-of-two 1/k are exact, so the parameters after every optimizer step are
bit-identical for W = 1, 2, 4, 8, ... (``tree.py`` says why the two levels give one tree).
"""
from typing import Any

import torch.distributed as dist

from .. import process

from .launcher import OrderedLauncher
from .store import TreeStore
from .tree import TreeSum, tree_sum


def ordered_parts(params: list, names: list[str], group: Any, config: Any) -> dict[str, Any]:
    """The reducer's store and launcher for ``deterministic=True``."""
    process.listen("accumulator", keep_reductions_apart)
    store = TreeStore(params, names, world_size=dist.get_world_size(group), caps=config.caps,
                      gradient_as_bucket_view=config.gradient_as_bucket_view)
    return {"store": store, "launcher": lambda plane: OrderedLauncher(group, plane, params)}


def is_deterministic(model: Any) -> bool:
    """Whether ``model`` is a gradsync wrapper built with ``deterministic=True``."""
    return bool(getattr(getattr(getattr(model, "reducer", None), "config", None), "deterministic", False))


def keep_reductions_apart(acc: Any) -> None:
    """``sync_each_batch`` reduces each micro-step across the ranks before the next: with micro-batch j on rank
    j % W as its micro-step j // W, a micro-step's reduction is a block of W leaves of the window's tree, and the
    blocks meet in a tree of their own (``TreeStore.keep_reductions_apart``): the same tree again."""
    if acc.sync_each_batch and is_deterministic(acc.model):
        acc.model.reducer.store.keep_reductions_apart()


__all__ = ["OrderedLauncher", "TreeStore", "TreeSum", "is_deterministic", "ordered_parts", "tree_sum"]
