"""Measure Chunked's activation memory and the communication of each accumulation mode.

    python benchmarks/memory/chunked.py [--quick] [--out DIR]

Part 1 (one process): peak tensor memory of forward+backward through a transformer MLP block, plain,
under torch.utils.checkpoint, and under gradsync.Chunked with 2-16 chunks. Memory is counted
exactly by a dispatch mode that follows every tensor storage created during the step (alive
until its storage is freed), so the numbers do not depend on the allocator or on other load.
Part 2 (2 local gloo ranks): collectives, bytes and time per accumulation window for no_sync,
sync_each_batch, num_items and Chunked, side by side with torch's DDP under the same accumulator.
Writes results/memory-chunked-<N>cpu-<date>.json and .md (a --quick run writes nothing).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

import gradsync
from gradsync.tools.bench.harness import RESULTS, LoadWatch, machine_info, record_stem, write_record
from gradsync.tools.demo import make_model, spirals
from gradsync.tools.launch import run_ranks

MiB = 2 ** 20


class LiveBytes(TorchDispatchMode):
    """Track the bytes of tensor storages created inside the mode; record the peak."""

    def __init__(self, existing: list[torch.Tensor]):
        super().__init__()
        self.live = self.peak = 0
        self.refs: dict[int, weakref.ref] = {}
        self.known = {t.untyped_storage().data_ptr() for t in existing}  # inputs, parameters

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
                if size and key not in self.refs and key not in self.known:
                    self.live += size
                    self.peak = max(self.peak, self.live)
                    self.refs[key] = weakref.ref(storage, lambda _r, k=key, n=size: self._free(k, n))
        return out

    def _free(self, key: int, size: int) -> None:
        self.live -= size
        self.refs.pop(key, None)


def mlp_block(d: int, hidden: int) -> nn.Module:
    """A transformer's feed-forward block: its activations are 2 x hidden/d times its input."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))


def memory_part(rows: int, d: int, hidden: int, reps: int) -> list[dict]:
    block = mlp_block(d, hidden)
    x = torch.randn(rows, d, generator=torch.Generator().manual_seed(1)).requires_grad_()
    runs = {"plain": block, "torch checkpoint": lambda t: checkpoint(block, t, use_reentrant=False)}
    runs.update({f"Chunked({c})": gradsync.Chunked(block, c) for c in (2, 4, 8, 16)})
    rows_out, reference = [], None
    for name, fn in runs.items():
        for p in block.parameters():
            p.grad = None
        x.grad = None
        tracker = LiveBytes([x, *block.parameters()])
        with tracker:
            out = fn(x)
            held = tracker.live - out.untyped_storage().nbytes()  # kept for backward
            out.square().mean().backward()
            del out
        got = [x.grad.clone()] + [p.grad.clone() for p in block.parameters()]
        reference = reference or got
        diff = max((a - b).abs().max().item() for a, b in zip(got, reference))
        rows_out.append({"run": name, "peak_mib": tracker.peak / MiB, "held_for_backward_mib": held / MiB,
                         "max_grad_diff": diff})
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(reps):  # round-robin, so load on the machine hits every run alike
        for name, fn in runs.items():
            start = time.perf_counter()
            fn(x).square().mean().backward()
            times[name].append(time.perf_counter() - start)
    for r in rows_out:
        r["ms"] = 1e3 * statistics.median(times[r["run"]])
        print(f"{r['run']:18s} peak {r['peak_mib']:8.1f} MiB  held {r['held_for_backward_mib']:8.1f} MiB  "
              f"{r['ms']:8.1f} ms  grad diff {r['max_grad_diff']:.1e}", flush=True)
    plain = rows_out[0]
    for r in rows_out:
        r["peak_vs_plain"] = r["peak_mib"] / plain["peak_mib"]
        r["time_vs_plain"] = r["ms"] / plain["ms"]
    return rows_out


MODES = {  # name: (wrapper, sync_each_batch, num_items, chunked)
    "gradsync no_sync": ("gradsync", False, False, False),
    "gradsync sync_each_batch": ("gradsync", True, False, False),
    "gradsync no_sync + num_items": ("gradsync", False, True, False),
    "gradsync no_sync + Chunked(4)": ("gradsync", False, False, True),
    "torch DDP no_sync": ("torch", False, False, False),
    "torch DDP sync_each_batch": ("torch", True, False, False),
}
CAPS = dict(bucket_cap_mb=0.03)  # a few buckets on the small demo model


def comm_rank(rank: int, world_size: int, steps: int, windows: int, rows: int) -> dict:
    counted = {"calls": 0, "bytes": 0}
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):  # every Python-level all-reduce gradsync makes
        counted["calls"] += 1
        counted["bytes"] += tensor.numel() * tensor.element_size()
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    x_all, y_all = spirals(steps * windows * rows * world_size)
    out = {}
    for name, (kind, each, items, chunked) in MODES.items():
        module = make_model().float()  # the recorded byte counts are for float32 gradients
        if chunked:
            module[2] = gradsync.Chunked(module[2], 4)
        if kind == "gradsync":
            model = gradsync.DDP(module, first_bucket_cap_mb=0.01, **CAPS)
        else:
            model = nn.parallel.DistributedDataParallel(module, **CAPS)
        buckets = {"calls": 0, "bytes": 0}

        def hook(state, bucket, buckets=buckets):
            buckets["calls"] += 1
            buckets["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
            if isinstance(bucket, gradsync.GradBucket):
                return gradsync.allreduce_hook(None, bucket)
            return default_hooks.allreduce_hook(None, bucket)

        model.register_comm_hook(None, hook)
        acc = gradsync.GradientAccumulator(model, steps=steps, sync_each_batch=each)
        opt = acc.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
        data = list(zip(x_all.split(rows * world_size), y_all.split(rows * world_size)))
        counted.update(calls=0, bytes=0)
        window_times, start = [], time.perf_counter()
        for x, y in acc.iterate(data):
            x, y = x[rank::world_size], y[rank::world_size]
            with acc.accumulate():
                if items:
                    acc.backward(F.cross_entropy(model(x), y, reduction="sum"), num_items=len(y))
                else:
                    acc.backward(F.cross_entropy(model(x), y))
                opt.step()
                opt.zero_grad(set_to_none=False)
            if acc.is_boundary:
                window_times.append(time.perf_counter() - start)
                start = time.perf_counter()
        grad_bytes = None  # torch's bucket buffers live in C++, out of sight
        if kind == "gradsync":
            grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
            grad_bytes += sum(b.buffer.numel() * b.buffer.element_size() for b in model.reducer.buckets)
        calls = counted["calls"] - (buckets["calls"] if kind == "gradsync" else 0)
        out[name] = {"bucket_collectives_per_window": buckets["calls"] / windows,
                     "bucket_bytes_per_window": buckets["bytes"] / windows,
                     "other_collectives_per_window": calls / windows if kind == "gradsync" else None,
                     "gradient_memory_bytes": grad_bytes,
                     "ms_per_window": 1e3 * statistics.median(window_times[1:])}
    dist.all_reduce = real_all_reduce
    return out


def comm_part(steps: int, windows: int, rows: int) -> dict:
    results = run_ranks(comm_rank, 2, steps, windows, rows, timeout=600)
    table = {}
    for name in MODES:
        row = dict(results[0][name])
        row["ms_per_window"] = max(r[name]["ms_per_window"] for r in results)
        table[name] = row
        print(f"{name:32s} " + "  ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    return table


def write(out: Path, memory: list[dict], comm: dict, config: dict, load: LoadWatch) -> None:
    data = {"scenario": "memory-chunked", "machine": machine_info(), "config": config, "torch": torch.__version__,
            **load.as_record(), "memory": memory, "communication": comm}
    lines = ["# Chunked memory and accumulation communication", "",
             f"torch {torch.__version__}, CPU, config: `{json.dumps(config)}`", "",
             "## Forward+backward of an MLP block (peak tensor memory, one process)", "",
             "| run | peak MiB | vs plain | held for backward MiB | ms (median) | vs plain | max grad diff |",
             "|---|---|---|---|---|---|---|"]
    for r in memory:
        lines.append(f"| {r['run']} | {r['peak_mib']:.1f} | {r['peak_vs_plain']:.2f} | "
                     f"{r['held_for_backward_mib']:.1f} | {r['ms']:.1f} | {r['time_vs_plain']:.2f} | "
                     f"{r['max_grad_diff']:.1e} |")
    lines += ["", f"## One accumulation window ({config['steps']} micro-steps, 2 gloo ranks, demo model)", "",
              "| mode | bucket all-reduces | bucket bytes | other all-reduces | grads + buckets bytes | "
              "ms per window (median) |", "|---|---|---|---|---|---|"]
    for name, r in comm.items():
        other = r["other_collectives_per_window"]
        other = "n/a" if other is None else f"{other:g}"
        lines.append(f"| {name} | {r['bucket_collectives_per_window']:g} | {r['bucket_bytes_per_window']:.0f} | "
                     f"{other} | {r['gradient_memory_bytes'] or 'n/a'} | {r['ms_per_window']:.1f} |")
    write_record(out, record_stem("memory-chunked"), data, "\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes, results not written (a smoke run)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    config = (dict(rows=256, d=64, hidden=512, reps=2, steps=4, windows=3, micro_rows=16) if args.quick
              else dict(rows=4096, d=512, hidden=2048, reps=5, steps=4, windows=12, micro_rows=64))
    with LoadWatch() as load:
        memory = memory_part(config["rows"], config["d"], config["hidden"], config["reps"])
        comm = comm_part(config["steps"], config["windows"], config["micro_rows"])
    if not args.quick:
        write(args.out, memory, comm, config, load)


if __name__ == "__main__":
    main()
