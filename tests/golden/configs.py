"""The golden configurations and their training loop: one place for make_golden.py and test_golden.py.

Every configuration trains a small ELEMENTWISE model on 2 or 3 forked gloo ranks for ``WINDOWS``
optimizer steps and records, per rank and step, the synchronized gradients (``.grad``, ``.main_grad``
where it exists, a sharded model's gradient shards) before the optimizer step and the parameters
after it. ``tests/golden/golden.pt`` holds what today's engine produced; a faithful redesign of the
engine must reproduce it bit for bit.

Why the numbers cannot depend on the CPU model (AVX2 vs AVX-512, BLAS blocking, FMA or not):
- No matmul, conv or transcendental function: every operation is an elementwise add, sub, mul,
  div, relu, abs, cat, slice or view, each one correctly rounded whatever the vector width.
- Every parameter broadcasts over the batch dimension only, and a rank's batch has at most 2 rows,
  so each reduction of a parameter's gradient over the batch is a single (commutative) addition.
- Losses are ``(y * C).sum() / 2``, ``.mean()`` over 32 elements or, with num_items, ``.sum()``: their
  gradients are exact scales of ``C`` (the loss value itself is never used).
- Data, ``C`` and initial parameters are multiples of 1/8 in [-2, 2] (exact in bf16 too).
- Plain SGD with lr = 2**-4, no momentum, ``foreach=False``: ``p.add_(g, alpha=-lr)`` where
  ``-lr * g`` is exact, so FMA or not gives the same single rounding.
- Averaging scales a copied gradient by 1 / W and divides a ``.grad`` that already was its view by W, as
  torch's reducer (each a correctly rounded op); gloo sums in the order its algorithm and the bucket
  layout fix, which is exactly what the golden pins.
- One intra-op thread per rank (``run_ranks`` sets it), so no reduction is split across threads.
Checked when the golden was made: the same bits under ATEN_CPU_CAPABILITY=avx512, avx2 and default
(under default, an FMA ``add(alpha=0.1)``, a 64-row sum and a small matmul all change bits).

What the configurations can see: with 2 ranks every sum of two values is commutative and the mean
divides by 2 exactly, so 2-rank results pin roundings, scalings, hooks, accumulation and which
gradients exist, not the bucket layout; the 3-rank configurations also pin the order in which
gloo sums the ranks' values, which follows from the bucket layout (and its rebuild).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.utils.checkpoint
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import gradsync
from gradsync.tools.launch import run_ranks

WINDOWS = 3  # optimizer steps recorded per configuration
K = 3  # micro-steps per window where a configuration accumulates
ROWS = 2  # rows per rank and micro-step: a batch reduction is one addition
FEATURES = 16
LR = 2.0 ** -4
CAPS = dict(bucket_cap_mb=0.0001, first_bucket_cap_mb=0.00005)  # 26 and 13 floats: many buckets
GOLDEN_FORMAT = 2


def eighths(shape, generator, lo=-16, hi=16) -> torch.Tensor:
    """Multiples of 1/8 in [lo/8, hi/8], drawn from ``generator``."""
    return torch.randint(lo, hi + 1, shape, generator=generator).to(torch.float32) / 8


class Elementwise(nn.Module):
    """h = relu(z0 - z1) + |z2 * z3| with z = x * W + B (4 rows of W, B); a mixing block; a 2-D
    block; an output scale. Parameters of 8 and 64 elements, registered in an order unlike the
    order their gradients become ready, so the engine's bucket rebuild changes the layout.

    ``unused``: adds ``sometimes`` (used where ``forward(use_sometimes=True)``) and ``never``.
    ``checkpointed``: the mixing block runs under reentrant activation checkpointing.
    """

    def __init__(self, dtype=torch.float32, unused=False, checkpointed=False):
        super().__init__()
        g = torch.Generator().manual_seed(20240611)

        def p(*shape):
            return nn.Parameter(eighths(shape, g).to(dtype))

        self.out_scale = p(8)
        self.in_w = p(4, FEATURES)
        self.mix_b = p(8)
        self.in_b = p(4, FEATURES)
        self.mix_w = p(8)
        self.blk_w = p(2, 4)
        self.mix_v = p(8)
        self.blk_b = p(2, 4)
        if unused:
            self.sometimes = p(FEATURES)
            self.never = p(5)
        self.unused, self.checkpointed = unused, checkpointed

    def _mix(self, h):
        return h[:, :8] * self.mix_w + h[:, 8:] * self.mix_v + self.mix_b

    def forward(self, x, use_sometimes=True):
        z = x.unsqueeze(1) * self.in_w + self.in_b  # (n, 4, 16): in_w, in_b broadcast over rows only
        h = torch.relu(z[:, 0] - z[:, 1]) + (z[:, 2] * z[:, 3]).abs()
        if self.unused and use_sometimes:
            h = h * self.sometimes
        if self.checkpointed:
            h2 = torch.utils.checkpoint.checkpoint(self._mix, h, use_reentrant=True)
        else:
            h2 = self._mix(h)
        h3 = h2.reshape(-1, 2, 4) * self.blk_w + self.blk_b
        return torch.cat([h3.reshape(-1, 8), h2 * self.out_scale], dim=1)  # (n, 16)


def loss_weights(dtype) -> torch.Tensor:
    return eighths((FEATURES,), torch.Generator().manual_seed(7)).to(dtype)


def global_batches(n, world_size, seed=11) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [eighths((world_size * ROWS, FEATURES), g) for _ in range(n)]


def rows_of(x, rank) -> torch.Tensor:
    return x[rank * ROWS:(rank + 1) * ROWS]


# Item counts (per micro-step, per rank) for num_items: unequal across ranks, zeros included, no
# window summing to zero. 9 micro-steps = 3 windows of K.
ITEMS = [[2, 1, 2], [1, 2, 0], [2, 0, 1], [0, 2, 2], [2, 2, 1], [1, 1, 0], [2, 1, 1], [1, 0, 2], [1, 2, 2]]


@dataclass(frozen=True)
class Config:
    world_size: int
    loop: str  # "plain", "no_sync", "acc" or "join"
    ddp: dict = field(default_factory=dict)  # keywords for the wrapper, on top of CAPS
    model: dict = field(default_factory=dict)  # keywords for Elementwise
    wrapper: str = "ddp"  # "ddp" or "sharded"
    hook: str | None = None  # "allreduce" or "fp16": torch's default_hooks
    overlap: bool = False
    acc: dict = field(default_factory=dict)  # GradientAccumulator keywords
    items: bool = False  # acc.backward(loss_sum, num_items=n)
    mean: bool = False  # mean loss instead of sum / 2
    unused_pattern: bool = False  # 'sometimes' used on some ranks in some micro-steps (uses_sometimes)
    counts: tuple = ()  # join: batches per rank
    join: dict = field(default_factory=dict)  # model.join() keywords


BF16 = dict(model=dict(dtype=torch.bfloat16), ddp=dict(reduce_dtype=torch.float32))

CONFIGS: dict[str, Config] = {
    "default": Config(2, "plain"),
    "views": Config(2, "plain", ddp=dict(gradient_as_bucket_view=True)),
    "hook_allreduce": Config(2, "plain", hook="allreduce"),
    "hook_fp16": Config(2, "plain", hook="fp16"),
    "hook_fp16_views": Config(2, "plain", hook="fp16", ddp=dict(gradient_as_bucket_view=True)),
    "reduce_dtype_bf16": Config(2, "plain", **BF16),
    "reduce_dtype_bf16_no_sync": Config(2, "no_sync", **BF16),
    "find_unused": Config(2, "plain", ddp=dict(find_unused_parameters=True), model=dict(unused=True),
                          unused_pattern=True),
    "find_unused_no_sync": Config(2, "no_sync", ddp=dict(find_unused_parameters=True), model=dict(unused=True),
                                  unused_pattern=True),
    "static_graph": Config(2, "plain", ddp=dict(static_graph=True)),
    "static_graph_checkpoint": Config(2, "plain", ddp=dict(static_graph=True), model=dict(checkpointed=True)),
    "no_sync": Config(2, "no_sync"),
    "no_sync_views": Config(2, "no_sync", ddp=dict(gradient_as_bucket_view=True)),
    "acc": Config(2, "acc", mean=True),
    "acc_sync_each_batch": Config(2, "acc", mean=True, acc=dict(sync_each_batch=True)),
    "acc_items": Config(2, "acc", items=True),
    "acc_items_sync_each_batch": Config(2, "acc", items=True, acc=dict(sync_each_batch=True)),
    "sharded": Config(2, "plain", wrapper="sharded"),
    "sharded_acc": Config(2, "acc", wrapper="sharded", mean=True),
    "sharded_acc_sync_each_batch": Config(2, "acc", wrapper="sharded", mean=True, acc=dict(sync_each_batch=True)),
    "sharded_acc_items": Config(2, "acc", wrapper="sharded", items=True),
    "overlap": Config(2, "plain", overlap=True),
    "overlap_views": Config(2, "plain", overlap=True, ddp=dict(gradient_as_bucket_view=True)),
    "overlap_acc": Config(2, "acc", overlap=True, mean=True),
    "join": Config(2, "join", counts=(3, 2)),
    "join_views": Config(2, "join", counts=(2, 3), ddp=dict(gradient_as_bucket_view=True)),
    # 3 ranks: division by 3 rounds, and gloo's order of summing 3 values is pinned
    "w3_default": Config(3, "plain"),
    "w3_views": Config(3, "plain", ddp=dict(gradient_as_bucket_view=True)),
    "w3_hook_fp16": Config(3, "plain", hook="fp16"),
    "w3_reduce_dtype_bf16": Config(3, "plain", **BF16),
    "w3_no_sync": Config(3, "no_sync"),
    "w3_acc": Config(3, "acc", mean=True),
    "w3_acc_items": Config(3, "acc", items=True),
    "w3_sharded": Config(3, "plain", wrapper="sharded"),
    "w3_sharded_acc_items": Config(3, "acc", wrapper="sharded", items=True),
    "w3_hook_allreduce": Config(3, "plain", hook="allreduce"),
    "w3_reduce_dtype_bf16_no_sync": Config(3, "no_sync", **BF16),
    "w3_find_unused_no_sync": Config(3, "no_sync", ddp=dict(find_unused_parameters=True), model=dict(unused=True),
                                     unused_pattern=True),
    "w3_static_graph_checkpoint": Config(3, "plain", ddp=dict(static_graph=True), model=dict(checkpointed=True)),
    "w3_acc_sync_each_batch": Config(3, "acc", mean=True, acc=dict(sync_each_batch=True)),
    "w3_overlap": Config(3, "plain", overlap=True),
    "w3_sharded_acc": Config(3, "acc", wrapper="sharded", mean=True),
    "w3_join": Config(3, "join", counts=(3, 2, 3)),
    "w3_join_active": Config(3, "join", counts=(3, 3, 2), join=dict(divide_by_initial_world_size=False)),
}


# ---------------------------------------------------------------- one configuration on one rank
def uses_sometimes(rank: int, j: int) -> bool:
    """Whether micro-step ``j`` (window index in the plain loop) uses ``sometimes`` on ``rank``.

    Plain loop: window 0 rank 0 only, window 1 both, window 2 neither (grad stays None).
    no_sync loop: rank 0 only in micro-steps under no_sync (pytorch#69031), rank 1 in micro-steps 1 and 5.
    """
    return j % 3 != 2 if rank == 0 else j % 4 == 1


def make_loss(cfg: Config, out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (out * weights).mean() if cfg.mean else (out * weights).sum() / 2


class Recorder:
    def __init__(self, name: str, rank: int, model: nn.Module):
        self.prefix, self.model, self.out = f"{name}/rank{rank}", model, {}

    def _put(self, step, kind, name, t):
        self.out[f"{self.prefix}/step{step}/{kind}/{name}"] = t.detach().clone()

    def grads(self, step) -> None:
        for n, p in self.model.module.named_parameters():
            if p.grad is not None:
                self._put(step, "grad", n, p.grad)
            if getattr(p, "main_grad", None) is not None:
                self._put(step, "main_grad", n, p.main_grad)
        if isinstance(self.model, gradsync.ShardedDataParallel):
            for i, b in enumerate(self.model.reducer.buckets):
                self._put(step, "grad_shard", str(i), b.grad_shard)

    def params(self, step) -> None:
        for n, p in self.model.module.named_parameters():
            self._put(step, "param", n, p)


def run_config(name: str, cfg: Config, rank: int, world_size: int) -> dict[str, torch.Tensor]:
    assert world_size == cfg.world_size, (name, world_size)
    dtype = cfg.model.get("dtype", torch.float32)
    module = Elementwise(**cfg.model)
    if cfg.wrapper == "sharded":
        model = gradsync.ShardedDataParallel(module, **CAPS, **cfg.ddp)
        opt = gradsync.ShardedOptimizer(model, torch.optim.SGD, lr=LR, foreach=False)
    else:
        model = gradsync.DistributedDataParallel(module, **CAPS, **cfg.ddp)
        opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)
    if cfg.hook is not None:
        hook = {"allreduce": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook}[cfg.hook]
        model.register_comm_hook(None, hook)
    weights = loss_weights(dtype)
    data = [x.to(dtype) for x in global_batches(WINDOWS * K, world_size)]
    rec = Recorder(name, rank, model)

    def forward(x, j):
        if cfg.unused_pattern:
            return model(x, use_sometimes=uses_sometimes(rank, j))
        return model(x)

    if cfg.loop == "plain":
        if cfg.overlap:
            gradsync.overlap_optimizer(model, opt)
        for w in range(WINDOWS):
            opt.zero_grad()
            make_loss(cfg, forward(rows_of(data[w], rank), w), weights).backward()
            rec.grads(w)
            opt.step()
            rec.params(w)
    elif cfg.loop == "no_sync":
        for w in range(WINDOWS):
            opt.zero_grad()
            for m in range(K):
                j = w * K + m
                x = rows_of(data[j], rank)
                if m == 0:  # forward and backward inside no_sync
                    with model.no_sync():
                        (make_loss(cfg, forward(x, j), weights) / K).backward()
                elif m < K - 1:  # only the backward inside no_sync
                    loss = make_loss(cfg, forward(x, j), weights) / K
                    with model.no_sync():
                        loss.backward()
                else:
                    (make_loss(cfg, forward(x, j), weights) / K).backward()
            rec.grads(w)
            opt.step()
            rec.params(w)
    elif cfg.loop == "acc":
        acc = gradsync.GradientAccumulator(model, steps=K, **cfg.acc)
        opt = acc.wrap_optimizer(opt)
        if cfg.overlap:
            gradsync.overlap_optimizer(model, opt)
        w = 0
        for j, x in enumerate(acc.iterate(data)):
            with acc.accumulate():
                xs = rows_of(x, rank)
                if cfg.items:
                    n = ITEMS[j][rank]
                    out = model(xs[:n])
                    acc.backward((out * weights).sum(), num_items=torch.tensor(n) if j % 2 else n)
                else:
                    acc.backward(make_loss(cfg, model(xs), weights))
                boundary = acc.is_boundary
                if boundary:
                    rec.grads(w)
                opt.step()
                if boundary:
                    rec.params(w)
                    w += 1
                opt.zero_grad()
        assert w == WINDOWS, (name, w)
    elif cfg.loop == "join":
        with model.join(**cfg.join):
            for w in range(cfg.counts[rank]):
                opt.zero_grad()
                make_loss(cfg, model(rows_of(data[w], rank)), weights).backward()
                rec.grads(w)
                opt.step()
                rec.params(w)
        rec.params("final")
    else:
        raise ValueError(cfg.loop)
    return rec.out


def run_rank(rank: int, world_size: int, names: list[str]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name in names:
        out.update(run_config(name, CONFIGS[name], rank, world_size))
    return out


def by_world_size(names=None) -> dict[int, list[str]]:
    groups: dict[int, list[str]] = {}
    for name in (CONFIGS if names is None else names):
        groups.setdefault(CONFIGS[name].world_size, []).append(name)
    return groups


def run_world(world_size: int, names: list[str], timeout: float = 120.0) -> dict[str, torch.Tensor]:
    """All of ``names`` (configurations of this world size) in one multi-rank run, bounded in time."""
    results: dict[str, torch.Tensor] = {}
    for rank_out in run_ranks(run_rank, world_size, names, timeout=timeout):
        results.update(rank_out)
    return results


def run_all(names=None) -> dict[str, torch.Tensor]:
    results: dict[str, torch.Tensor] = {}
    for world_size, group in sorted(by_world_size(names).items()):
        results.update(run_world(world_size, group))
    return results


# ---------------------------------------------------------------- the golden file
# Format: {"format", "meta", "groups": {"config/rankR/stepS/kind": (flat tensor, layout)}}. A group's
# tensors (one kind of one step of one rank) are concatenated; layout is "name:shape;..." in order,
# the same str object wherever it repeats (pickle then writes it once). The flat tensors are views
# into one storage per dtype, so torch.save writes a few storages instead of a zip entry per tensor.
def pack(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, str]]:
    groups: dict[str, list[str]] = {}
    for key in sorted(tensors):
        groups.setdefault(key.rsplit("/", 1)[0], []).append(key)
    layouts: dict[str, str] = {}  # each distinct layout once, as one object
    layout_of: dict[str, str] = {}
    flats: dict[str, torch.Tensor] = {}
    for group, keys in groups.items():
        dtypes = {tensors[k].dtype for k in keys}
        assert len(dtypes) == 1, (group, dtypes)
        layout = ";".join(f"{k.rsplit('/', 1)[1]}:{'x'.join(map(str, tensors[k].shape))}" for k in keys)
        layout_of[group] = layouts.setdefault(layout, layout)
        flats[group] = torch.cat([tensors[k].reshape(-1) for k in keys])
    by_dtype: dict[torch.dtype, list[str]] = {}
    for group, flat in flats.items():
        by_dtype.setdefault(flat.dtype, []).append(group)
    out = {}
    for dtype, names in by_dtype.items():
        storage = torch.cat([flats[g] for g in names])
        offset = 0
        for g in names:
            n = flats[g].numel()
            out[g] = (storage[offset:offset + n], layout_of[g])
            offset += n
    return out


def unpack(groups: dict[str, tuple[torch.Tensor, str]]) -> dict[str, torch.Tensor]:
    tensors = {}
    for group, (flat, layout) in groups.items():
        offset = 0
        for entry in layout.split(";"):
            name, shape = entry.rsplit(":", 1)
            shape = tuple(int(d) for d in shape.split("x")) if shape else ()
            n = 1
            for d in shape:
                n *= d
            tensors[f"{group}/{name}"] = flat[offset:offset + n].view(shape).clone()
            offset += n
        assert offset == flat.numel(), group
    return tensors


def save_golden(path, tensors: dict[str, torch.Tensor], **meta: str) -> None:
    blob = {"format": GOLDEN_FORMAT, "meta": {k: str(v) for k, v in meta.items()}, "groups": pack(tensors)}
    torch.save(blob, path)
    again = load_golden(path)
    assert again.keys() == tensors.keys() and all(torch.equal(again[k], tensors[k]) and
                                                  again[k].dtype == tensors[k].dtype for k in tensors)


def load_golden(path, with_meta: bool = False):
    """The recorded tensors by key (and, ``with_meta``, the dict of strings the generator stored)."""
    blob = torch.load(path, weights_only=True)
    assert blob["format"] == GOLDEN_FORMAT, f"golden format {blob['format']}, expected {GOLDEN_FORMAT}"
    tensors = unpack(blob["groups"])
    return (tensors, blob["meta"]) if with_meta else tensors


def describe(key: str) -> str:
    config, rank, step, kind, name = key.split("/", 4)
    return f"config {config}, {rank}, {step}, {kind} {name}"


def differences(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Every way ``got`` differs from ``want`` bit for bit (values, dtype, shape, which tensors exist)."""
    problems = []
    for key in sorted(want.keys() - got.keys()):
        problems.append(f"{describe(key)}: missing (the golden run had it)")
    for key in sorted(got.keys() - want.keys()):
        problems.append(f"{describe(key)}: unexpected (the golden run had none, e.g. grad None)")
    for key in sorted(want.keys() & got.keys()):
        a, b = got[key], want[key]
        if a.dtype != b.dtype or a.shape != b.shape:
            problems.append(f"{describe(key)}: {a.dtype} {tuple(a.shape)}, golden {b.dtype} {tuple(b.shape)}")
        elif not torch.equal(a, b):
            diff = (a.double() - b.double()).abs()
            problems.append(f"{describe(key)}: {int((a != b).sum())} of {a.numel()} elements differ, "
                            f"max |diff| {diff.max().item():.3g}")
    return problems
