"""What a gradient must be to enter its bucket, and what a reduced bucket must be to leave it."""
from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch


def is_view_of(grad: torch.Tensor | None, view: torch.Tensor) -> bool:
    return grad is not None and grad.data_ptr() == view.data_ptr()


def warn_create_graph() -> None:
    warnings.warn(
        "gradsync: backward(create_graph=True) with DistributedDataParallel: the gradients are "
        "averaged across ranks, but the higher-order graph is not (as in torch's DDP): gradients of "
        "the gradients stay rank-local.", stacklevel=4)


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
        "was not finite). The gradients were not written back; skip this step (optimizer.zero_grad()) or "
        "lower the learning rate / use loss scaling.")


__all__ = ["check_finite", "check_grad", "is_view_of", "warn_create_graph"]
