"""Models, data and references shared by the multi-rank tests."""
from __future__ import annotations

import torch
from torch import nn

import gradsync


def mlp(seed: int = 0, width: int = 32, depth: int = 3, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    d = 8
    for _ in range(depth - 1):
        layers += [nn.Linear(d, width), nn.Tanh()]
        d = width
    layers.append(nn.Linear(d, 4))
    return nn.Sequential(*layers).to(dtype)


def batches(steps: int, world_size: int, per_rank: int = 6, seed: int = 1, features: int = 8):
    """Deterministic global batches: a list of (x, y) with world_size * per_rank rows each."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randn(world_size * per_rank, features, generator=g)
        y = torch.randn(world_size * per_rank, 4, generator=g)
        out.append((x, y))
    return out


def shard(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return t.chunk(world_size)[rank]


def grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def assert_close_dicts(a: dict, b: dict, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=rtol, msg=lambda m, k=k: f"{k}: {m}")


class Branches(nn.Module):
    """`a` always runs; `b` runs when asked; `never` never runs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(8, 4)
        self.never = nn.Linear(8, 4)

    def forward(self, x, use_b=True):
        out = self.a(x)
        return out + self.b(x) if use_b else out


def count_collectives(model) -> list[int]:
    """Record the index of every bucket the model reduces, via a hook around the default all-reduce."""
    calls: list[int] = []

    def hook(state, bucket):
        calls.append(bucket.index())
        return gradsync.allreduce_hook(None, bucket)

    model.register_comm_hook(None, hook)
    return calls
