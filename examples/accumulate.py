"""Gradient accumulation with gradsync.GradientAccumulator on the demo model, checked against one process.

Local, 2 forked gloo ranks (no GPU needed):
    PYTHONPATH=src python examples/accumulate.py
    PYTHONPATH=src python examples/accumulate.py --num-items --sync-each-batch --chunks 4
Under torchrun (one process per GPU with --backend nccl, or CPU processes with gloo):
    PYTHONPATH=src torchrun --nproc_per_node=2 examples/accumulate.py --backend gloo

Every global micro-batch has --batch rows; rank r takes rows r::W. --micro is not a multiple of
--accum on purpose: the last window is short, closes where the data ends, and is normalized by
its real length. With --num-items some rows are padding (a random mask): the loss is a sum over
real rows and the window's gradient is the mean over every real row of every rank. A mean loss
matches one process only when every rank holds as many rows (e.g. --nproc 3 with --batch 32 does
not, and the check fails by about 1e-2); --num-items is exact either way.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import gradsync
from gradsync.tools.demo import make_model, spirals


def micro_batches(args) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Global micro-batches (x, y, mask); mask marks real rows (all real without --num-items)."""
    x, y = spirals(args.micro * args.batch)
    x = x.to(torch.float64)  # the demo model is float64
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(len(y), generator=g) < 0.7 if args.num_items else torch.ones(len(y), dtype=torch.bool)
    return list(zip(x.split(args.batch), y.split(args.batch), mask.split(args.batch)))


def build_model(args) -> torch.nn.Module:
    model = make_model(seed=0)
    if args.chunks > 1:  # the widest layer, chunk by chunk: fewer activations, the same gradients
        model[2] = gradsync.Chunked(model[2], args.chunks)
    return model


def schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda window: 1 / (1 + 0.1 * window))


def train(rank: int, world_size: int, args) -> dict:
    device = torch.device("cuda", rank % torch.cuda.device_count()) if args.backend == "nccl" else None
    model = gradsync.DistributedDataParallel(build_model(args).to(device))
    acc = gradsync.GradientAccumulator(model, steps=args.accum, sync_each_batch=args.sync_each_batch)
    optimizer = acc.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=args.lr))
    scheduler = acc.wrap_scheduler(schedule(optimizer))
    mine = [(x[rank::world_size], y[rank::world_size], m[rank::world_size])
            for x, y, m in micro_batches(args)]
    windows, window_loss = 0, 0.0
    for x, y, mask in acc.iterate(mine):
        x, y, mask = x.to(device), y.to(device), mask.to(device)
        with acc.accumulate():
            if args.num_items:
                loss = F.cross_entropy(model(x), y, reduction="none")[mask].sum()
                acc.backward(loss, num_items=int(mask.sum()))
            else:
                loss = F.cross_entropy(model(x), y)
                acc.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        window_loss += loss.item()
        if acc.is_boundary:
            windows += 1
            if rank == 0 and (windows % args.log_every == 0 or windows == 1):
                lr = optimizer.param_groups[0]["lr"]
                print(f"window {windows:3d}  loss {window_loss:9.4f}  lr {lr:.2e}", flush=True)
            window_loss = 0.0
    return {"params": {n: p.detach().cpu() for n, p in model.module.named_parameters()}, "windows": windows}


def single_process(args) -> dict[str, torch.Tensor]:
    """The reference: one process, every rank's rows at once, the same windows and schedule."""
    model = build_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = schedule(optimizer)
    data = micro_batches(args)
    for start in range(0, len(data), args.accum):
        window = data[start:start + args.accum]
        items = sum(int(m.sum()) for _, _, m in window)
        for x, y, mask in window:
            losses = F.cross_entropy(model(x), y, reduction="none")
            (losses[mask].sum() / items if args.num_items else losses.mean() / len(window)).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def check(result: dict, args) -> None:
    want = -(-args.micro // args.accum)
    reference = single_process(args)
    worst = max((result["params"][n] - p).abs().max().item() for n, p in reference.items())
    print(f"{result['windows']} optimizer steps (expected {want}); "
          f"max |parameter difference| vs one process: {worst:.2e}")
    if result["windows"] != want or worst > 1e-4:
        raise SystemExit("check FAILED")
    print("check passed")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="local ranks when not under torchrun")
    p.add_argument("--micro", type=int, default=42, help="micro-batches in the data")
    p.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    p.add_argument("--batch", type=int, default=32, help="global rows per micro-batch")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--sync-each-batch", action="store_true", help="communicate every micro-step")
    p.add_argument("--num-items", action="store_true", help="padding rows; normalize by real rows")
    p.add_argument("--chunks", type=int, default=1, help="run the hidden layer in this many chunks")
    p.add_argument("--log-every", type=int, default=3)
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    args = p.parse_args(argv)
    if "RANK" not in os.environ:
        from gradsync.tools.launch import run_ranks
        check(run_ranks(train, args.nproc, args, timeout=600)[0], args)
        return
    dist.init_process_group(args.backend)  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR
    result = train(dist.get_rank(), dist.get_world_size(), args)
    if dist.get_rank() == 0:
        check(result, args)
    # leave together: with torch 2.13 under torchrun, a rank that tears gloo down while a peer is
    # still working was seen to abort at exit
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
