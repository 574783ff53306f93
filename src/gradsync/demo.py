"""Train a small classifier data-parallel with gradient accumulation, then check it against one process.

Local (what `make demo` runs): 2 gloo processes forked on this machine, no GPU needed:
    gradsync demo                       # or: python -m gradsync.demo --local
Many nodes, NCCL, one process per GPU:
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HOST:29500 \\
        -m gradsync.demo --backend nccl

The data is generated deterministically (three interleaved spirals), so every run, on any number
of ranks, sees the same global batches; rank r takes rows r::W of each global batch.
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


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(2, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(),
                         nn.Linear(128, 3))


def global_batches(args) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = spirals(args.steps * args.accum * args.batch)
    return list(zip(x.split(args.batch), y.split(args.batch)))


def train(rank: int, world_size: int, args) -> dict:
    """Train on this rank's rows of every global batch; return the final parameters and losses."""
    device = torch.device("cuda", rank % torch.cuda.device_count()) if args.backend == "nccl" else None
    model = gradsync.DistributedDataParallel(make_model(seed=rank).to(device))  # rank 0's weights win
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    micro = global_batches(args)
    losses, start = [], time.perf_counter()
    for step in range(args.steps):
        window = micro[step * args.accum:(step + 1) * args.accum]
        for k, (x, y) in enumerate(window):
            x, y = x[rank::world_size].to(device), y[rank::world_size].to(device)
            # Communicate only on the window's last micro-step; earlier ones accumulate locally.
            model.require_backward_grad_sync = k == len(window) - 1
            loss = F.cross_entropy(model(x), y) / len(window)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item() * len(window))
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            elapsed = time.perf_counter() - start
            rate = (step + 1) * args.accum * args.batch / elapsed
            print(f"step {step:4d}  loss {losses[-1]:.4f}  {rate:9.0f} samples/s", flush=True)
    final = {n: p.detach().cpu().clone() for n, p in model.module.named_parameters()}
    return {"params": final, "losses": losses, "seconds": time.perf_counter() - start}


def single_process(args) -> dict[str, torch.Tensor]:
    """The reference: one process, full global batches, the same optimizer."""
    model = make_model(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    micro = global_batches(args)
    for step in range(args.steps):
        window = micro[step * args.accum:(step + 1) * args.accum]
        for x, y in window:
            (F.cross_entropy(model(x), y) / len(window)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def check_equivalence(result: dict, args) -> float:
    reference = single_process(args)
    worst = max((result["params"][n] - p).abs().max().item() for n, p in reference.items())
    print(f"max |parameter difference| vs one process on the global batches: {worst:.2e}")
    if worst > 1e-4:
        raise SystemExit("equivalence check FAILED")
    print("equivalence check passed")
    return worst


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="local ranks (with --local)")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps")
    p.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    p.add_argument("--batch", type=int, default=64, help="global micro-batch size")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--local", action="store_true", help="fork --nproc local gloo ranks")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.local or "RANK" not in os.environ:
        from .launch import run_ranks
        print(f"training on {args.nproc} local gloo ranks, accumulation {args.accum}")
        result = run_ranks(train, args.nproc, args, timeout=600)[0]
        check_equivalence(result, args)
        return
    dist.init_process_group(args.backend)  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR
    result = train(dist.get_rank(), dist.get_world_size(), args)
    if dist.get_rank() == 0:
        check_equivalence(result, args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
