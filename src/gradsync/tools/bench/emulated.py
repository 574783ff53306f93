"""Models for an emulated cluster (``benchmarks/speed/cluster.py``): a device whose compute is sleeps.

``Device``'s layers sleep for the forward and backward a GPU would take, around a cheap but real
(data-dependent) weight gradient, so the CPU is free while the "device" computes, as on a GPU host,
and full-size gradients still cross the link. ``Many`` is a model of many small parameters.
``Spec`` builds them and their batches as ``models.ModelSpec`` does for ``gradsync bench``'s models.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from .models import ModelSpec

__all__ = ["model_classes", "Spec", "spec_of"]


def model_classes() -> tuple[type, type]:
    """``Device`` (sleeps for its compute around a real, cheap gradient) and ``Many`` (blocks of
    Linear + LayerNorm: many small parameters)."""
    class DeviceLayer(torch.autograd.Function):
        """Sleeps for the device's compute; the weight's gradient is cheap but real (data-dependent)."""

        @staticmethod
        def forward(ctx, x, w, pattern, fwd_s, bwd_s):
            time.sleep(fwd_s)
            ctx.save_for_backward(pattern)
            ctx.bwd_s = bwd_s
            return x + w[0]

        @staticmethod
        def backward(ctx, g):
            time.sleep(ctx.bwd_s)
            (pattern,) = ctx.saved_tensors
            gw = pattern * g.mean()
            gw[0] += g.sum(0)
            return g, gw, None, None, None

    class Device(nn.Module):
        def __init__(self, depth, width, fwd_ms, bwd_ms, classes=16):
            super().__init__()
            self.weights = nn.ParameterList(nn.Parameter(torch.randn(width, width) * 0.01) for _ in range(depth))
            self.patterns = [torch.randn(width, width) * 1e-3 for _ in range(depth)]  # not buffers: no broadcast
            self.head = nn.Linear(width, classes)
            self.fwd_s, self.bwd_s = fwd_ms / 1e3, bwd_ms / 1e3

        def forward(self, x):
            for w, p in zip(self.weights, self.patterns):
                x = DeviceLayer.apply(x, w, p, self.fwd_s, self.bwd_s)
            return self.head(x)

    class Many(nn.Module):
        def __init__(self, blocks, width, classes=16):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width))
                                        for _ in range(blocks))
            self.head = nn.Linear(width, classes, bias=False)

        def forward(self, x):
            for b in self.blocks:
                x = x + b(x)
            return self.head(x)

    return Device, Many


@dataclass(frozen=True)
class Spec:
    """A model and its per-rank batch (``build`` and ``batch_for``, as ``gradsync bench``'s ModelSpec)."""

    name: str
    kind: str  # device, many
    width: int
    depth: int
    batch: int
    fwd_ms: float = 0.0
    bwd_ms: float = 0.0

    def build(self, seed: int = 0):
        torch.set_flush_denormal(True)
        torch.manual_seed(seed)
        device, many = model_classes()
        if self.kind == "device":
            return device(self.depth, self.width, self.fwd_ms, self.bwd_ms)
        return many(self.depth, self.width)

    def batch_for(self, rank: int, step: int):
        g = torch.Generator().manual_seed(1000 * step + rank)
        return torch.randn(self.batch, self.width, generator=g), torch.randint(0, 16, (self.batch,), generator=g)


def spec_of(name: str):
    """The models ``benchmarks/speed/cluster.py`` knows by name: device-like, many-parameter and CPU ones."""
    return {"device-8x1024": Spec("device-8x1024", "device", 1024, 8, 32, 2.0, 4.0),
            "device-tiny": Spec("device-tiny", "device", 64, 2, 4, 0.5, 1.0),
            "many-801": Spec("many-801", "many", 64, 200, 32),
            "many-tiny": Spec("many-tiny", "many", 16, 10, 4),
            "mlp-8.4M": ModelSpec(name="mlp-8.4M", kind="mlp", width=1024, depth=8, batch=32),
            "gpt-12M": ModelSpec(name="gpt-12M", kind="gpt", width=384, depth=6, batch=2, seq=64),
            "mlp-tiny": ModelSpec(name="mlp-tiny", kind="mlp", width=64, depth=2, batch=4)}[name]
