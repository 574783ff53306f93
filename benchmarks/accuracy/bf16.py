"""What bf16 gradients lose in accumulation and reduction, and what reduce_dtype=torch.float32 keeps.

    python benchmarks/accuracy/bf16.py   # writes results/accuracy-bf16-<N>cpu-<date>.{json,md,png}

A small GPT with bf16 parameters, on W gloo ranks, accumulates k micro-steps and reduces once.
Per row: (i) relative L2 error of the window's averaged gradient against the exact fp64 sum of the
same per-micro-step gradients (each rank recomputes its micro-steps on a plain copy and the sums
are all-reduced in fp64), (ii) against one fp64 process on the global batch; gradient memory per
rank after the synced step (``.grad`` plus bucket buffers; torch's C++ reducer keeps buckets of one
gradient copy, counted as such) and the mean time of a window. Then LOSS_STEPS optimizer steps of
(a) and (c), both stepping fp32 master weights, so only the gradient's precision differs.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import gradsync
from gradsync.tools.bench.harness import RESULTS, LoadWatch, machine_info, record_stem, write_record
from gradsync.tools.bench.models import GPT
from gradsync.tools.launch import run_ranks

ROWS = ["(a) torch DDP, bf16 grads", "(b) gradsync default", "(c) reduce_dtype=float32",
        "(d) reduce_dtype=float32 + bf16_wire_hook", "(e) fp32 parameters"]
SIZE = dict(vocab=256, dim=64, layers=2, heads=2, seq=32)
MICRO_BATCH = 2  # sequences per micro-step and rank


def tokens(n: int, seed: int) -> torch.Tensor:
    """n sequences of SIZE['seq'] + 1 tokens from a fixed random Markov chain (learnable)."""
    g = torch.Generator().manual_seed(1234)
    table = torch.randint(SIZE["vocab"], (SIZE["vocab"], 4), generator=g)
    g.manual_seed(seed)
    seq = torch.empty(n, SIZE["seq"] + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(SIZE["vocab"], (n,), generator=g)
    for t in range(SIZE["seq"]):
        seq[:, t + 1] = table[seq[:, t], torch.randint(4, (n,), generator=g)]
    return seq


def model(dtype: torch.dtype) -> GPT:
    torch.manual_seed(0)
    return GPT(**SIZE).to(dtype)


def loss_of(module, batch: torch.Tensor) -> torch.Tensor:
    logits = module(batch[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def wrap(row: str):
    dtype = torch.float32 if row.startswith("(e)") else torch.bfloat16
    if row.startswith("(a)"):
        return torch.nn.parallel.DistributedDataParallel(model(dtype))
    ddp = gradsync.DDP(model(dtype), reduce_dtype=torch.float32 if row[1] in "cd" else None)
    if row.startswith("(d)"):
        ddp.register_comm_hook(None, gradsync.bf16_wire_hook)
    return ddp


def reduced_grads(ddp, row: str) -> list[torch.Tensor]:
    use_main = row[1] in "cd"
    return [(p.main_grad if use_main else p.grad).double() for p in ddp.module.parameters()]


def rel(got: list[torch.Tensor], exact: list[torch.Tensor]) -> float:
    num = sum((g - e).pow(2).sum() for g, e in zip(got, exact))
    return float((num / sum(e.pow(2).sum() for e in exact)).sqrt())


def grad_bytes(ddp, row: str) -> int:
    grads = sum(p.grad.numel() * p.grad.element_size() for p in ddp.module.parameters() if p.grad is not None)
    if row.startswith("(a)"):
        return 2 * grads  # .grad + the C++ reducer's bucket copy
    return grads + sum(b.buffer.numel() * b.buffer.element_size() for b in ddp.reducer.buckets)


def measure(rank: int, world_size: int, steps: int, windows: int) -> dict:
    data = tokens(world_size * MICRO_BATCH * steps * windows, seed=steps)
    micro = data.view(windows, steps, world_size, MICRO_BATCH, -1)
    out = {}
    for row in ROWS:
        dtype = torch.float32 if row.startswith("(e)") else torch.bfloat16
        plain, exact = model(dtype), None
        for j in range(steps):  # this rank's per-micro-step gradients, summed in fp64 over ranks
            plain.zero_grad()
            (loss_of(plain, micro[0, j, rank]) / steps).backward()
            grads = [p.grad.double() for p in plain.parameters()]
            exact = grads if exact is None else [e + g for e, g in zip(exact, grads)]
        for e in exact:
            dist.all_reduce(e)
            e.div_(world_size)
        ref = model(torch.float64)
        loss_of(ref, micro[0].reshape(-1, micro.shape[-1])).backward()
        fp64 = [p.grad for p in ref.parameters()]
        ddp = wrap(row)
        times = []
        for w in range(windows):
            ddp.zero_grad(set_to_none=True)
            start = time.perf_counter()
            for j in range(steps):
                ddp.require_backward_grad_sync = j == steps - 1
                (loss_of(ddp, micro[w, j, rank]) / steps).backward()
            times.append(time.perf_counter() - start)
            if w == 0:
                got = reduced_grads(ddp, row)
                err_acc, err_e2e, memory = rel(got, exact), rel(got, fp64), grad_bytes(ddp, row)
        out[row] = {"accumulation_error": err_acc, "end_to_end_error": err_e2e,
                    "grad_memory_mib": memory / 2 ** 20, "window_s": statistics.median(times[1:] or times)}
        del ddp
    return out


def curve(rank: int, world_size: int, row: str, steps: int, accumulation: int) -> list[float]:
    ddp = wrap(row)
    params = list(ddp.module.parameters())
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW(masters, lr=3e-3)
    data = tokens(world_size * MICRO_BATCH * accumulation * steps, seed=7)
    micro = data.view(steps, accumulation, world_size, MICRO_BATCH, -1)
    losses = []
    for s in range(steps):
        total = 0.0
        for j in range(accumulation):
            ddp.require_backward_grad_sync = j == accumulation - 1
            loss = loss_of(ddp, micro[s, j, rank]) / accumulation
            loss.backward()
            total += loss.item()
        for m, p in zip(masters, params):
            m.grad = (p.main_grad if row[1] == "c" else p.grad).float()
        opt.step()
        opt.zero_grad()
        ddp.zero_grad(set_to_none=True)
        with torch.no_grad():
            for m, p in zip(masters, params):
                p.copy_(m)
        losses.append(total)
    return losses


def markdown(record: dict) -> str:
    lines = ["# bf16 gradients: accumulation and reduction error, memory, time", "",
             f"GPT {record['size']} ({record['params']} parameters), {MICRO_BATCH} sequences per "
             "micro-step and rank, gloo on CPU. (i): relative L2 error of the averaged window gradient "
             "against the exact fp64 sum of the same per-micro-step gradients (for (e): its own fp32 "
             "ones); (ii): against one fp64 process on the global batch. Memory: `.grad` plus bucket "
             "buffers per rank after the synced step. Time: median window (all micro-steps + sync).", "",
             "| ranks | accumulation | row | (i) accumulation+reduction | (ii) end-to-end | grad MiB/rank | window ms |",
             "|---|---|---|---|---|---|---|"]
    for r in record["rows"]:
        lines.append(f"| {r['ranks']} | {r['accumulation']} | {r['row']} | {r['accumulation_error']:.2e} | "
                     f"{r['end_to_end_error']:.2e} | {r['grad_memory_mib']:.2f} | {1e3 * r['window_s']:.1f} |")
    if record.get("curves"):
        c = record["curves"]
        lines += ["", f"Loss curves: {c['steps']} AdamW steps (fp32 masters) at accumulation {c['accumulation']}, "
                  f"2 ranks, same data: final loss (mean of the last 10) "
                  + ", ".join(f"{k}: {statistics.mean(v[-10:]):.4f}" for k, v in c["losses"].items())
                  + f". Plot: {record['stem']}.png."]
    return "\n".join(lines) + "\n"


def plot(record: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, losses in record["curves"]["losses"].items():
        ax.plot(losses, label=name, linewidth=1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"{record['stem']}.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--accumulation", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--loss-steps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", help="file name stem (default: accuracy-bf16-<N>cpu-<date>)")
    args = parser.parse_args(argv)
    out, stem = args.out, args.name or record_stem("accuracy-bf16")
    out.mkdir(parents=True, exist_ok=True)
    rows, load = [], LoadWatch()
    for ranks in args.ranks:
        for steps in args.accumulation:
            result = run_ranks(measure, ranks, steps, args.windows, timeout=1800)[0]
            rows += [{"ranks": ranks, "accumulation": steps, "row": row, **v} for row, v in result.items()]
            print(f"{ranks} ranks, accumulation {steps}: "
                  + ", ".join(f"{row[:3]} {v['accumulation_error']:.1e}" for row, v in result.items()), flush=True)
    record = {"scenario": "accuracy-bf16", "stem": stem, "machine": machine_info(), "size": SIZE,
              "params": sum(p.numel() for p in model(torch.float32).parameters()), "rows": rows}
    if args.loss_steps:
        accumulation = 8
        record["curves"] = {"steps": args.loss_steps, "accumulation": accumulation, "losses": {
            row: run_ranks(curve, 2, row, args.loss_steps, accumulation, timeout=1800)[0] for row in (ROWS[0], ROWS[2])}}
        plot(record, out)
    record.update(load.as_record())
    write_record(out, stem, record, markdown(record))
    return record


if __name__ == "__main__":
    sys.exit(main() and 0)
