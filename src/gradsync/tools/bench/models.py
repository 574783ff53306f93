"""Models, data and training engines that ``gradsync bench`` compares.

An engine wraps one copy of a model for one data-parallel implementation and exposes the same
two calls, ``micro_step(x, y, sync)`` and ``optimizer_step()``, so the timing loop is identical
for gradsync, torch's C++ DDP, a naive per-parameter all-reduce and (when present) gradsync's
sharded mode. Models have no buffers, so no engine broadcasts anything before a forward.
"""
from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gradsync
from gradsync._torch import foreach_div_


# ---------------------------------------------------------------- models
class MLP(nn.Module):
    def __init__(self, width: int, depth: int, classes: int = 16):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, classes)
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.gelu(layer(x))
        return self.head(x)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A small decoder-only transformer (pre-norm, causal attention, tied embeddings)."""

    def __init__(self, vocab: int = 4096, dim: int = 384, layers: int = 6, heads: int = 6, seq: int = 64):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.vocab = vocab

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.ln(x) @ self.tok.weight.t()


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A benchmark model: its name, how to build it and a per-rank batch for it."""

    name: str
    kind: str  # "mlp" or "gpt"
    width: int = 0
    depth: int = 0
    batch: int = 8  # rows (mlp) or sequences (gpt) per rank per micro-step
    seq: int = 64

    def build(self, seed: int = 0) -> nn.Module:
        # Every benchmark builds its models on the rank's main thread, which then does the compute
        # (one thread per rank). Flush denormals there: after AdamW's first steps the GPT's backward
        # computes on denormal floats, 2-4x slower, decaying over ~15 windows for every engine alike,
        # a trend that buried the differences being measured.
        torch.set_flush_denormal(True)
        torch.manual_seed(seed)
        if self.kind == "mlp":
            return MLP(self.width, self.depth)
        if self.kind == "gpt":
            return GPT(dim=self.width, layers=self.depth, heads=self.width // 64, seq=self.seq)
        raise ValueError(f"unknown model kind {self.kind!r}")

    def batch_for(self, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * step + rank)
        if self.kind == "mlp":
            return torch.randn(self.batch, self.width, generator=g), torch.randint(0, 16, (self.batch,), generator=g)
        tokens = torch.randint(0, 4096, (self.batch, self.seq + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]


def mlp_for_params(params: float, depth: int = 4, batch: int = 16) -> ModelSpec:
    """Return an MLP spec with about ``params`` parameters (``depth`` square layers)."""
    width = max(16, int(round(math.sqrt(params / depth) / 16)) * 16)
    return ModelSpec(name=f"mlp-{human(depth * width * width)}", kind="mlp", width=width, depth=depth, batch=batch)


def human(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def count_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


# ---------------------------------------------------------------- engines
def _no_probe(phase: str):
    return contextlib.nullcontext()


class Engine:
    """One data-parallel implementation wrapped around its own copy of the model.

    ``view`` None takes the engine's own ``view`` (gradsync: the recommended gradient views).
    ``micro_step``'s ``probe(phase)`` is a context manager around each phase (the profiling pass).
    """

    name = "?"
    view = False

    def __init__(self, module: nn.Module, *, bucket_cap_mb: float, view: bool | None, set_to_none: bool,
                 lr: float):
        self.set_to_none = set_to_none
        self.model = self.wrap(module, bucket_cap_mb, self.view if view is None else view)
        self.opt = self.make_optimizer(lr)

    def wrap(self, module, bucket_cap_mb, view):
        raise NotImplementedError

    def make_optimizer(self, lr: float):
        return torch.optim.AdamW(self.model.parameters(), lr=lr)

    def micro_step(self, x, y, sync: bool, probe=_no_probe) -> None:
        with contextlib.nullcontext() if sync else self.model.no_sync():
            with probe("forward"):
                loss = loss_fn(self.model(x), y)
            with probe("backward"):
                loss.backward()

    def optimizer_step(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=self.set_to_none)


class GradsyncEngine(Engine):
    name = "gradsync"
    view = True  # what docs/choosing.md recommends

    def wrap(self, module, bucket_cap_mb, view):
        return gradsync.DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=view)


class CompressedEngine(GradsyncEngine):
    """gradsync with the bf16 compression hook: half the bytes, a cast each way."""

    name = "gradsync-bf16"

    def wrap(self, module, bucket_cap_mb, view):
        model = super().wrap(module, bucket_cap_mb, view)
        model.register_comm_hook(None, gradsync.bf16_compress_hook)
        return model


class TorchEngine(Engine):
    name = "torch"  # torch's defaults: no gradient views

    def wrap(self, module, bucket_cap_mb, view):
        return nn.parallel.DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb,
                                                   gradient_as_bucket_view=view)


class TorchViewsEngine(TorchEngine):
    """torch's DDP with ``gradient_as_bucket_view=True``: like for like with gradsync's setting."""

    name = "torch-views"
    view = True


class NaiveEngine(Engine):
    """All-reduce every gradient separately after backward: no buckets, no overlap."""

    name = "naive"

    def wrap(self, module, bucket_cap_mb, view):
        for p in module.parameters():  # same starting point as the wrapped engines
            dist.broadcast(p.data, src=0)
        return module

    def micro_step(self, x, y, sync: bool, probe=_no_probe) -> None:
        with probe("forward"):
            loss = loss_fn(self.model(x), y)
        with probe("backward"):
            loss.backward()
        if sync:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            with probe("collective"):
                works = [dist.all_reduce(g, async_op=True) for g in grads]
                for w in works:
                    w.wait()
            with probe("division"):
                foreach_div_(grads, dist.get_world_size())


class ShardedEngine(Engine):
    """gradsync's ZeRO-2-style mode (only when this gradsync has it)."""

    name = "gradsync-sharded"

    def wrap(self, module, bucket_cap_mb, view):
        return gradsync.ShardedDataParallel(module, bucket_cap_mb=bucket_cap_mb)

    def make_optimizer(self, lr: float):
        return gradsync.ShardedOptimizer(self.model, torch.optim.AdamW, lr=lr)


def available_engines() -> list[type[Engine]]:
    engines: list[type[Engine]] = [GradsyncEngine, TorchEngine, TorchViewsEngine, NaiveEngine, CompressedEngine]
    if hasattr(gradsync, "ShardedDataParallel") and hasattr(gradsync, "ShardedOptimizer"):
        engines.append(ShardedEngine)
    return engines


def make_engines(spec: ModelSpec, names: list[str], *, bucket_cap_mb: float = 25.0, view: bool | None = None,
                 set_to_none: bool = True, lr: float = 1e-3) -> dict[str, Engine]:
    """Build every named engine on an identical copy of ``spec``'s model (rank 0's weights)."""
    by_name = {e.name: e for e in available_engines()}
    base = spec.build(seed=0)
    return {n: by_name[n](copy.deepcopy(base), bucket_cap_mb=bucket_cap_mb, view=view,
                          set_to_none=set_to_none, lr=lr) for n in names}
