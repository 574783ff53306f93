"""Train a spiral classifier data-parallel with gradient accumulation, then check it against one process.

Local (what `make demo` runs): 2 gloo processes forked on this machine, no GPU needed:
    gradsync demo                         # or: python -m gradsync.tools.demo --local
    gradsync demo --nproc 4 --accum 8     # more ranks, longer windows
    gradsync demo --elastic               # 3 replicas; one is SIGKILLed mid-run and rejoins
Many nodes, NCCL, one process per GPU (rank 0 prints the summary and writes the plot):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HOST:29500 \\
        -m gradsync.tools.demo --backend nccl

The data is generated deterministically (three interleaved spirals) and shuffled with a seeded
generator, so every run, on any number of ranks, sees the same global micro-batches; rank r takes
rows r::W of each. The single-process reference replays them, so the final parameters must match.
The model is float64: over hundreds of Adam steps, float32 rounding differences between averaging
per-rank gradients and one large batch grow to ~1e-2, which would hide a real discrepancy.
"""
from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gradsync


def spirals(n: int, classes: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % classes
    t = torch.rand(n, generator=g) * 3 * math.pi
    angle = t + y * (2 * math.pi / classes)
    x = torch.stack([t * angle.cos(), t * angle.sin()], 1) / (3 * math.pi)
    return x + 0.02 * torch.randn(n, 2, generator=g), y


def make_model(seed: int = 0, width: int = 128) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(2, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                         nn.Linear(width, width), nn.GELU(), nn.Linear(width, 3)).double()


def epoch_batches(args, epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The epoch's global micro-batches, in the same shuffled order on every rank."""
    x, y = spirals(args.samples)
    x = x.double()
    perm = torch.randperm(args.samples, generator=torch.Generator().manual_seed(epoch))
    return list(zip(x[perm].split(args.batch), y[perm].split(args.batch)))


def accuracy(module: nn.Module) -> float:
    device = next(module.parameters()).device
    x, y = spirals(1024, seed=1)  # held-out points
    with torch.no_grad():
        return (module(x.double().to(device)).argmax(1).cpu() == y).float().mean().item()


def progress(rank: int, total: int, desc: str):
    """A tqdm bar on rank 0 (a plain line if tqdm is not installed); a no-op elsewhere."""
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if rank != 0:
        return _Quiet()
    if tqdm is None:
        return _Line(desc)
    return tqdm(total=total, desc=desc, unit="batch", leave=True, dynamic_ncols=True)


class _Quiet:
    def update(self, n=1): pass
    def set_postfix(self, **kw): self.kw = kw
    def close(self): pass


class _Line(_Quiet):
    def __init__(self, desc): self.desc = desc
    def close(self): print(self.desc, " ".join(f"{k}={v}" for k, v in getattr(self, "kw", {}).items()), flush=True)


def build(args, rank: int, device):
    """The wrapped model and its optimizer, for the chosen mode."""
    module = make_model(seed=rank).to(device)  # ranks start apart: rank 0's weights are broadcast
    if args.sharded:
        model = gradsync.ShardedDataParallel(module)
        return model, gradsync.ShardedOptimizer(model, torch.optim.AdamW, lr=args.lr)
    model = gradsync.DistributedDataParallel(module)
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr)


def train(rank: int, world_size: int, args) -> dict:
    """Train on this rank's rows of every global micro-batch; return rank 0's record."""
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.backend == "nccl" else None
    model, opt = build(args, rank, device)
    model.enable_comm_trace()  # every synced backward's buckets, drawn at the end (export_trace)
    use_accumulator = args.sync_each_batch or args.sharded
    if use_accumulator:
        acc = gradsync.GradientAccumulator(model, steps=args.accum, sync_each_batch=args.sync_each_batch)
        opt = acc.wrap_optimizer(opt)
    losses, accs, synced, micro_steps = [], [], 0, 0
    start = time.perf_counter()
    for epoch in range(args.epochs):
        batches = [(x[rank::world_size].to(device), y[rank::world_size].to(device))
                   for x, y in epoch_batches(args, epoch)]
        bar = progress(rank, len(batches), f"epoch {epoch + 1:2d}/{args.epochs}")
        window_loss = 0.0
        if use_accumulator:
            for x, y in acc.iterate(batches):
                with acc.accumulate():
                    loss = F.cross_entropy(model(x), y)
                    synced += acc.sync_gradients
                    acc.backward(loss)
                opt.step()
                opt.zero_grad()
                window_loss += loss.item() / args.accum
                if acc.is_boundary:
                    losses.append(window_loss)
                    window_loss = 0.0
                micro_steps += 1
                bar.update()
        else:
            for k, (x, y) in enumerate(batches):
                last = k % args.accum == args.accum - 1
                # Communicate only on the window's last micro-step; earlier ones accumulate locally.
                model.require_backward_grad_sync = last
                loss = F.cross_entropy(model(x), y) / args.accum
                loss.backward()
                window_loss += loss.item()
                synced += last
                micro_steps += 1
                if last:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    losses.append(window_loss)
                    window_loss = 0.0
                bar.update()
        accs.append(accuracy(model.module))
        bar.set_postfix(loss=f"{losses[-1]:.3f}", test_acc=f"{accs[-1]:.3f}")
        bar.close()
    seconds = time.perf_counter() - start
    os.makedirs(args.out, exist_ok=True)
    model.export_trace(os.path.join(args.out, "trace.json"))  # every rank takes part; rank 0 writes
    grad_bytes = sum(p.numel() * p.element_size() for p in model.module.parameters())
    final = {n: p.detach().cpu().clone() for n, p in model.module.named_parameters()}
    return {"params": final, "losses": losses, "accuracy": accs, "seconds": seconds, "synced": synced,
            "micro_steps": micro_steps, "grad_bytes": grad_bytes, "world": world_size}


def single_process(args) -> dict[str, torch.Tensor]:
    """The reference: one process, whole global micro-batches, the same optimizer and windows."""
    model = make_model(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    for epoch in range(args.epochs):
        batches = epoch_batches(args, epoch)
        for start in range(0, len(batches), args.accum):
            for x, y in batches[start:start + args.accum]:
                (F.cross_entropy(model(x), y) / args.accum).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def summarize(result: dict, args) -> float:
    """Print throughput, communication, accuracy and the equivalence check; write the plot."""
    mib = result["grad_bytes"] / 2**20
    avoided = result["micro_steps"] - result["synced"]
    print(f"\n{result['world']} ranks, accumulation {args.accum}"
          + (", sync each batch" if args.sync_each_batch else "") + (", sharded" if args.sharded else ""))
    print(f"  throughput      {result['micro_steps'] * args.batch / result['seconds']:,.0f} samples/s "
          f"({result['seconds']:.1f} s for {args.epochs} epochs)")
    print(f"  communication   {result['synced']} of {result['micro_steps']} backward passes reduced gradients; "
          f"accumulation avoided {avoided} reductions ({avoided * mib:.1f} MiB of gradients, "
          f"{avoided / result['micro_steps']:.0%})")
    print(f"  result          final training loss {result['losses'][-1]:.4f}, "
          f"held-out accuracy {result['accuracy'][-1]:.1%}")
    reference = single_process(args)
    worst = max((result["params"][n] - p).abs().max().item() for n, p in reference.items())
    print(f"  equivalence     max |parameter difference| vs one process on the global batches: {worst:.2e}")
    print(f"  comm trace      {os.path.join(args.out, 'trace.json')} (every rank's buckets, own work and waits: "
          "open it in chrome://tracing or ui.perfetto.dev)")
    plot(result, args)
    if worst > args.tolerance:
        raise SystemExit(f"equivalence check FAILED (tolerance {args.tolerance:g})")
    print("  equivalence check passed")
    return worst


def plot(result: dict, args) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from .bench.plots import plain_log_labels
    except ImportError:
        print("  (loss curve skipped: matplotlib is not installed; `pip install matplotlib`)")
        return
    os.makedirs(args.out, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps_per_epoch = len(result["losses"]) / args.epochs
    ax.plot(range(1, len(result["losses"]) + 1), result["losses"], label="training loss (rank 0)")
    ax.set(xlabel="optimizer step", ylabel="cross-entropy", yscale="log")
    plain_log_labels(ax.yaxis)
    ax.set_title(f"gradsync demo: {result['world']} ranks, accumulation {args.accum}", pad=22)  # room for the legend
    acc_ax = ax.twinx()
    acc_ax.plot([steps_per_epoch * (e + 1) for e in range(args.epochs)], result["accuracy"], "o-",
                color="tab:green", label="held-out accuracy")
    acc_ax.set(ylabel="accuracy", ylim=(0, 1.05))
    # one legend for both axes, in a row between the title and the axes: it never covers a curve
    lines = ax.get_lines() + acc_ax.get_lines()
    ax.legend(lines, [line.get_label() for line in lines], loc="lower center", bbox_to_anchor=(0.5, 1.0),
              ncol=2, fontsize=8, frameon=False)
    fig.tight_layout()
    path = os.path.join(args.out, "loss.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"  loss curve      {path}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="gradsync demo", description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="local ranks (default 2)")
    p.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    p.add_argument("--sync-each-batch", action="store_true",
                   help="reduce gradients every micro-batch (gradsync.GradientAccumulator)")
    p.add_argument("--sharded", action="store_true", help="shard gradients and optimizer state "
                   "(gradsync.ShardedDataParallel + ShardedOptimizer)")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--samples", type=int, default=3072, help="training points per epoch")
    p.add_argument("--batch", type=int, default=64, help="global micro-batch size")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--tolerance", type=float, default=1e-4, help="max parameter difference vs one process")
    p.add_argument("--out", default="demo-output", help="directory for the loss curve")
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--local", action="store_true", help="fork --nproc local gloo ranks")
    p.add_argument("--elastic", action="store_true", help="3 replicas under `gradsync run`; one is SIGKILLed "
                   "mid-run and rejoins (tools/elastic/demo.py)")
    args = p.parse_args(argv)
    given = {k for k, v in vars(args).items() if v != p.get_default(k)} - {"elastic", "out"}
    if args.elastic and given:
        p.error("--elastic runs a fixed job (3 replicas, one SIGKILLed and restarted): it takes --out only")
    if min(args.nproc, args.accum, args.epochs, args.samples, args.batch) < 1:
        p.error("--nproc, --accum, --epochs, --samples and --batch must be at least 1")
    if args.nproc < 2 and "RANK" not in os.environ:  # one rank reduces nothing: the demo's numbers would mislead
        p.error("--nproc must be at least 2: a data-parallel demo needs two ranks")
    if args.backend == "nccl" and "RANK" not in os.environ:  # the local ranks are forked gloo ranks
        p.error("--backend nccl needs a launcher that sets RANK (torchrun -m gradsync.tools.demo --backend nccl)")
    if args.samples % (args.batch * args.accum):
        p.error(f"--samples ({args.samples}) must be a multiple of --batch x --accum "
                f"({args.batch * args.accum}) so every window is full")
    missing = [name for flag, name in ((args.sync_each_batch, "GradientAccumulator"),
                                       (args.sharded, "GradientAccumulator"),
                                       (args.sharded, "ShardedDataParallel"),
                                       (args.sharded, "ShardedOptimizer"))
               if flag and not hasattr(gradsync, name)]
    if missing:
        p.error(f"this gradsync has no {', '.join(sorted(set(missing)))}; "
                "--sync-each-batch and --sharded need a gradsync version that provides them")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.elastic:
        from .elastic.demo import main as elastic_demo
        elastic_demo(args.out)
        return
    if args.local or "RANK" not in os.environ:
        from .launch import run_ranks
        if args.batch % args.nproc:
            raise SystemExit(f"--batch ({args.batch}) must be divisible by --nproc ({args.nproc})")
        print(f"training on {args.nproc} local gloo ranks, accumulation {args.accum}, "
              f"{args.epochs} epochs of {args.samples} spiral points")
        torch.set_num_threads(1)
        result = run_ranks(train, args.nproc, args, timeout=600)[0]
        summarize(result, args)
        return
    dist.init_process_group(args.backend)  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR
    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    result = train(dist.get_rank(), dist.get_world_size(), args)
    if dist.get_rank() == 0:
        summarize(result, args)
    # leave together: with torch 2.13 under torchrun, a rank that tears gloo down while a peer is
    # still working was seen to abort at exit
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
