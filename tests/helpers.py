"""Models, data, rank loops, one-process references and fault probes shared by the multi-rank tests."""
from __future__ import annotations

import contextlib
import multiprocessing
import subprocess
import sys
import time
import traceback

import torch
import torch.nn.functional as F
from torch import nn

import gradsync
from gradsync.tools.launch import run_ranks

# Fault tests: gradsync's bound on every wait, and how late past it an error may come on a 2-core
# machine shared with other CPU-bound work. The process group's own timeout (PG_TIMEOUT) is far
# beyond both, so an error within TIMEOUT + SLACK proves gradsync's bound fired, not torch's.
TIMEOUT = 2.0
SLACK = 10.0
PG_TIMEOUT = 30.0


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


class Normed(nn.Module):
    """A model with buffers, so every forward starts with a buffer broadcast."""

    def __init__(self, width: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, width)
        self.bn = nn.BatchNorm1d(width)

    def forward(self, x):
        return self.bn(self.lin(x))


def count_collectives(model) -> list[int]:
    """Record the index of every bucket the model reduces, via a hook around the default all-reduce."""
    calls: list[int] = []

    def hook(state, bucket):
        calls.append(bucket.index())
        return gradsync.allreduce_hook(None, bucket)

    model.register_comm_hook(None, hook)
    return calls


# ---------------------------------------------------------------- rank loops
def shard_backward(model, rank: int, world_size: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """Back-propagate the mean loss on this rank's shard of the global batch (x, y)."""
    F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()


def rank_steps(model, rank, world_size, data, opt=None) -> list[dict[str, torch.Tensor]]:
    """This rank's side of ``reference`` with one batch a step: clear the gradients, back-propagate
    on this rank's shard, record the synced gradients, step ``opt``. Return each step's gradients."""
    history = []
    for x, y in data:
        model.zero_grad(set_to_none=True)
        shard_backward(model, rank, world_size, x, y)
        history.append(grads(model.module))
        if opt is not None:
            opt.step()
    return history


def item_losses(model, x, y, n):
    """A summed loss over the first ``n`` rows (like tokens that are not padding) and its count."""
    return F.mse_loss(model(x[:n]), y[:n], reduction="sum"), n


def item_counts(micro, world_size, rows, seed=3):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, rows + 1, (micro, world_size), generator=g)
    counts[:, 0].clamp_(min=1)  # rank 0 has an item in every micro-step: no window sums to zero
    return counts.tolist()


def micro_steps(model, acc, opt, rank, world_size, data, counts=None):
    """Run ``acc``'s micro-steps on this rank's shards of ``data``; yield each one's index inside its
    ``accumulate()`` block, after the backward and before ``opt`` (if any) steps and zeroes.

    Mean losses, or with ``counts`` (per micro-step, per rank) a summed loss over that many rows,
    whose count goes to ``acc.backward`` as an int and as a tensor in turn.
    """
    for k, (x, y) in enumerate(acc.iterate(data)):
        with acc.accumulate():
            xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
            if counts is None:
                acc.backward(F.mse_loss(model(xs), ys))
            else:
                loss, n = item_losses(model, xs, ys, counts[k][rank])
                acc.backward(loss, num_items=torch.tensor(n) if k % 2 else n)
            yield k
            if opt is not None:
                opt.step()
                opt.zero_grad()


# ---------------------------------------------------------------- one-process references
def reference(model, data, steps=1, opt=None, sched=None) -> list[dict[str, torch.Tensor]]:
    """Train ``model`` in one process on the global batches: windows of ``steps`` mean losses (the
    last one may be shorter), each scaled to weigh as one batch; ``opt`` and ``sched`` step after each
    window. Return every window's gradients."""
    history = []
    for start in range(0, len(data), steps):
        window = data[start:start + steps]
        for x, y in window:
            (F.mse_loss(model(x), y) / len(window)).backward()
        history.append(grads(model))
        if opt is not None:
            opt.step()
        if sched is not None:
            sched.step()
        model.zero_grad(set_to_none=True)
    return history


def reference_items(world_size, micro, steps, rows):
    """Windows of summed losses over ``item_counts`` rows, divided by the window's count on all ranks."""
    model = mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    counts = item_counts(micro, world_size, rows)
    data = batches(micro, world_size, per_rank=rows)
    window_grads = []
    for start in range(0, micro, steps):
        total = sum(sum(counts[k]) for k in range(start, min(start + steps, micro)))
        for k in range(start, min(start + steps, micro)):
            x, y = data[k]
            for r in range(world_size):
                loss, _ = item_losses(model, shard(x, r, world_size), shard(y, r, world_size), counts[k][r])
                (loss / total).backward()
        window_grads.append(grads(model))
        opt.step()
        opt.zero_grad()
    return window_grads, params(model)


def reference_unused(pattern, world_size):
    """Mean over ranks of each rank's locally accumulated ``Branches`` gradient (zeros where unused);
    ``pattern[k][rank]`` says whether micro-step k uses ``b`` on that rank."""
    total = None
    for rank in range(world_size):
        m = Branches()
        for k, (x, y) in enumerate(batches(len(pattern), world_size)):
            F.mse_loss(m(shard(x, rank, world_size), use_b=pattern[k][rank]),
                       shard(y, rank, world_size)).backward()
        g = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) / world_size
             for n, p in m.named_parameters() if n.split(".")[0] != "never"}
        total = g if total is None else {n: total[n] + g[n] for n in g}
    return total


# ---------------------------------------------------------------- faults
@contextlib.contextmanager
def cpu_hogs(n: int = 2):
    """``n`` CPU-bound processes beside the block: a shared, loaded machine for tests that must not misfire."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for h in hogs:
            h.kill()
            h.wait()


def outcome(fn):
    """Run ``fn``; return ("ok", None, seconds) or (exception type name, message, seconds)."""
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "ok", None, time.monotonic() - start


def faults(fn, *args, world_size=2):
    """Run ``fn`` on every rank with short bounds; return each rank's result or error."""
    return run_ranks(fn, world_size, *args, timeout=90, pg_timeout=PG_TIMEOUT, return_errors=True)


# ---------------------------------------------------------------- memory probes
def in_fresh_process(fn, *args, timeout: float = 180.0):
    """Return ``fn(*args)`` run in a newly started interpreter (spawned, not forked).

    Resident-memory probes need this: a forked child inherits the test process's heap, and an
    allocation that reuses a free, already resident chunk of it does not grow the resident set.
    """
    ctx = multiprocessing.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_reply, args=(send, fn, args))  # not a daemon: fn may fork ranks
    proc.start()
    send.close()
    try:
        if not recv.poll(timeout):
            raise TimeoutError(f"{fn.__name__} did not finish in {timeout} s in a fresh process")
        try:
            ok, value = recv.recv()
        except EOFError:
            proc.join(5)
            raise RuntimeError(f"{fn.__name__} died in a fresh process (exit code {proc.exitcode})") from None
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(5)
    if not ok:
        raise RuntimeError(f"{fn.__name__} failed in a fresh process:\n{value}")
    return value


def _reply(send, fn, args) -> None:
    try:
        send.send((True, fn(*args)))
    except BaseException:
        send.send((False, traceback.format_exc()))
