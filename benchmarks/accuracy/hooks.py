"""Measure what gradient compression costs in accuracy: fp16 and bf16 hooks against exact fp32.

    python benchmarks/accuracy/hooks.py   # writes results/accuracy-hooks-<N>cpu-<date>.{md,json}

Two local gloo ranks train the same MLP from the same start for STEPS steps, once per hook, on the
same data; we report the relative error of the first step's reduced gradient and the final loss.
"""
from __future__ import annotations

import argparse
import datetime
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import gradsync
from gradsync.tools.bench.harness import RESULTS, LoadWatch, machine_info, record_stem, write_record
from gradsync.tools.launch import run_ranks

STEPS = 200
HOOKS = {"none (fp32 all-reduce)": None, "fp16_compress_hook": gradsync.fp16_compress_hook,
         "bf16_compress_hook": gradsync.bf16_compress_hook}


def data(world_size: int, steps: int):
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(64, 8, generator=g)
    xs = torch.randn(steps, 32 * world_size, 64, generator=g)
    return xs, torch.tanh(xs @ teacher)


def train(rank: int, world_size: int, hook_name: str, steps: int):
    torch.manual_seed(0)
    model = gradsync.DDP(nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(),
                                       nn.Linear(512, 8)))
    if HOOKS[hook_name] is not None:
        model.register_comm_hook(None, HOOKS[hook_name])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    xs, ys = data(world_size, steps)
    first_grad, losses = None, []
    for x, y in zip(xs, ys):
        x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if first_grad is None:
            first_grad = torch.cat([p.grad.flatten() for p in model.parameters()])
        losses.append(loss.item())
        opt.step()
    return first_grad, sum(losses[-20:]) / len(losses[-20:])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    load = LoadWatch()
    runs = {name: run_ranks(train, 2, name, args.steps, timeout=600)[0] for name in HOOKS}
    exact, exact_loss = runs["none (fp32 all-reduce)"]
    rows, table = [], []
    for name, (grad, loss) in runs.items():
        rel = ((grad - exact).norm() / exact.norm()).item()
        table.append({"hook": name, "relative_error": rel, "max_abs_error": (grad - exact).abs().max().item(),
                      "final_loss": loss, "loss_ratio": loss / exact_loss})
        rows.append(f"| {name} | {rel:.2e} | {(grad - exact).abs().max().item():.2e} | {loss:.5f} | "
                    f"{loss / exact_loss:.4f} |")
    today = datetime.date.today().isoformat()
    record = {"scenario": "accuracy-hooks", "machine": machine_info(), "steps": args.steps, **load.as_record(),
              "rows": table}
    out = write_record(args.out, record_stem("accuracy-hooks"), record,
        f"# Accuracy cost of compression hooks ({today}, {platform.machine()}, torch {torch.__version__})\n\n"
        f"2 gloo ranks, MLP 64-512-512-8 (300k parameters), Adam lr 1e-3, {args.steps} steps, batch 32 per rank.\n"
        "Gradient error: first step's reduced gradient against the fp32 all-reduce. Loss: mean of the last 20 steps.\n\n"
        "| hook | relative gradient error | max abs gradient error | final loss | loss / fp32 loss |\n"
        "|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    print(out.read_text())
    sys.stdout.flush()


if __name__ == "__main__":
    main()
