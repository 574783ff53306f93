"""What a gradient must be to enter its bucket, and what a reduced bucket must be to leave it."""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any
from itertools import repeat
from operator import attrgetter, is_

import torch

_NEEDS_GRAD, _LAYOUT, _DTYPE, _SHAPE = map(attrgetter, ("requires_grad", "layout", "dtype", "shape"))


def is_view_of(grad: torch.Tensor | None, view: torch.Tensor) -> bool:
    return grad is not None and grad.layout is torch.strided and grad.data_ptr() == view.data_ptr()


def warn_create_graph() -> None:
    warnings.warn(
        "gradsync: backward(create_graph=True) with DistributedDataParallel: the gradients are "
        "averaged across ranks, but the higher-order graph is not (as in torch's DDP): gradients of "
        "the gradients stay rank-local.", stacklevel=4)


class Graphs(dict):
    """``backward(create_graph=True)``: each parameter's local gradient, its graph kept while its value is reduced.
    Written back, ``.grad`` is the average and its graph the local gradient / world size, as torch's DDP leaves it,
    so a penalty on ``.grad`` differentiates as it does there."""

    def keep(self, i: int, grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """Hold ``grad``'s graph until the write-back; return its value."""
        warn_create_graph()
        self[i], param.grad = grad, None  # not written into: its graph may have saved it
        return grad.detach()

    def rejoin(self, members: Sequence[int], params: Sequence[torch.Tensor], world_size: int) -> None:
        with torch.enable_grad():
            for i in [i for i in members if i in self]:
                params[i].grad = _Averaged.apply(self.pop(i), params[i].grad, world_size)


class _Averaged(torch.autograd.Function):
    """Forward the reduced value; backward into the local gradient's graph, divided by the world size."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, average: torch.Tensor, world_size: int) -> torch.Tensor:
        ctx.world_size = world_size
        return average.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad / ctx.world_size, None, None


def check_grad(grad: torch.Tensor, view: torch.Tensor, name: str) -> None:
    """Raise unless ``grad`` can be copied into its bucket slot ``view`` without conversion."""
    if grad.layout != torch.strided:
        raise RuntimeError(f"gradsync: parameter '{name}' has a {grad.layout} gradient; only dense "
                           "gradients are supported (e.g. nn.Embedding(sparse=False))")
    if grad.dtype != view.dtype:
        raise RuntimeError(f"gradsync: parameter '{name}' has a {grad.dtype} gradient, but it and its "
                           f"bucket are {view.dtype}; assign gradients of the parameter's dtype")
    if grad.shape != view.shape:
        raise RuntimeError(f"gradsync: parameter '{name}' has a gradient of shape {tuple(grad.shape)}, "
                           f"expected {tuple(view.shape)}")


def fit(grads: Sequence[torch.Tensor], views: Sequence[torch.Tensor]) -> bool:
    """Each of ``grads`` goes into its view as it is (no history, dense, the view's dtype and shape), checked in C
    loops: a Python call per gradient was most of what taking a window's first gradients into the views cost."""
    return (not any(map(_NEEDS_GRAD, grads)) and all(map(is_, map(_LAYOUT, grads), repeat(torch.strided)))
            and list(map(_DTYPE, grads)) == list(map(_DTYPE, views)) and list(map(_SHAPE, grads)) == list(map(_SHAPE, views)))


def check_finite(results: Sequence[torch.Tensor], members: Sequence[Sequence[int]],
                 params: Sequence[torch.Tensor], names: Sequence[str]) -> None:
    """Raise naming the parameters whose reduced gradient holds NaN or inf (one check per bucket)."""
    if bool(torch.stack([torch.isfinite(r).all() for r in results]).all()):
        return
    bad = [names[i] for result, idx in zip(results, members)
           for i, part in zip(idx, result.reshape(-1).split([params[i].numel() for i in idx]))
           if not bool(torch.isfinite(part).all())]
    raise FloatingPointError(
        f"gradsync: the synchronized gradient of {len(bad)} parameter(s) contains NaN or inf: "
        f"{', '.join(bad[:20])}{' ...' if len(bad) > 20 else ''} (on at least one rank the local gradient "
        "was not finite). The averages were not written back (with gradient views .grad is the bucket, reduced in "
        "place); skip this step (optimizer.zero_grad()) or "
        "lower the learning rate / use loss scaling.")


__all__ = ["Graphs", "check_finite", "check_grad", "fit", "is_view_of", "warn_create_graph"]
