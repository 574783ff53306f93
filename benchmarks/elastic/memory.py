"""What elastic membership costs in memory per rank: each option that keeps the window in the buckets, and sharding.

    python benchmarks/elastic/memory.py            # writes results/elastic-memory-<N>cpu-<date>.md
    python benchmarks/elastic/memory.py --quick    # a small model, prints the table, writes nothing

Each row is one job, ``gradsync run --replicas 3`` of this file (``--worker``): a 25.2M-parameter MLP
(6 x Linear(2048, 2048)), windows of 2 micro-steps, plain SGD (no optimizer state), 3 windows (PowerSGD rows: 4). The
same model is built on the elastic group (it follows membership) or with ``process_group=`` (it does
not). With gradient views or ``reduce_dtype`` an elastic model reduces a staged copy of each bucket,
so that a reduction that fails part-way leaves the window whole (``BucketStore.keep_window_apart``):
that copy is the price. ``ShardedDataParallel`` + ``ShardedOptimizer(AdamW)`` keeps each shard on two members
(``sharded/regroup.py``): the mirrored gradient shard, AdamW state and master copy are the price there. Per replica we report the peak RSS above its RSS before the model was built
(glibc returns every allocation of 1 MiB or more to the OS, so RSS follows live tensors) and the
bytes of gradient memory the model holds (buckets, staged copies, ``.grad`` apart from them).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from gradsync.tools.bench.harness import RESULTS, machine_info, record_stem

MiB = 1 << 20
CONFIGS = {  # name -> (dtype, DDP options, elastic)
    "fp32": ("float32", {}, False),
    "fp32, elastic": ("float32", {}, True),
    "fp32, gradient_as_bucket_view": ("float32", {"gradient_as_bucket_view": True}, False),
    "fp32, gradient_as_bucket_view, elastic": ("float32", {"gradient_as_bucket_view": True}, True),
    "bf16, reduce_dtype=float32": ("bfloat16", {"reduce_dtype": "float32"}, False),
    "bf16, reduce_dtype=float32, elastic": ("bfloat16", {"reduce_dtype": "float32"}, True),
    "fp32, PowerSGD": ("float32", {"powersgd": True}, False),
    "fp32, PowerSGD, elastic": ("float32", {"powersgd": True}, True),
    "fp32, sharded, AdamW": ("float32", {"sharded": True}, False),
    "fp32, sharded, AdamW, elastic": ("float32", {"sharded": True}, True),
    "bf16, sharded, reduce_dtype=float32, AdamW": ("bfloat16", {"sharded": True, "reduce_dtype": "float32"}, False),
    "bf16, sharded, reduce_dtype=float32, AdamW, elastic": ("bfloat16", {"sharded": True, "reduce_dtype": "float32"}, True),
}


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None and hasattr(t, "element_size"))


def sharded_record(model, inner) -> dict:
    """Sharded: the staging peak, this rank's gradient shards, and what mirroring adds (a shard, its state, its copy)."""
    store, mirror = model.reducer.store, inner.mirror
    state = lambda opt: nbytes(v for st in opt.state.values() for v in st.values())  # noqa: E731
    return {"buckets_mib": store.peak_staging_bytes / MiB, "grad_mib": nbytes(b.grad_shard for b in store.buckets) / MiB,
            "state_mib": (state(inner.optimizer) + (state(mirror.optimizer) if mirror else 0)) / MiB,
            "staged_mib": 0 if mirror is None else (nbytes(b.mirror_shard for b in store.buckets) + state(mirror.optimizer)
                                                    + nbytes(mirror.masters)) / MiB}


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import gradsync
    from gradsync.tools.bench.measure import reset_peak_rss, status_kib

    dtype, options, elastic = CONFIGS[args.config]
    options = {k: getattr(torch, v) if k == "reduce_dtype" else v for k, v in options.items()}
    gradsync.elastic.init_process_group("gloo", timeout=60)
    torch.set_num_threads(1)
    reset_peak_rss()
    base = status_kib("VmRSS")
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[m for _ in range(args.depth) for m in (torch.nn.Linear(args.width, args.width),
                                                                        torch.nn.Tanh())]).to(getattr(torch, dtype))
    sharded, powersgd = options.pop("sharded", False), options.pop("powersgd", False)
    wrapper = gradsync.ShardedDataParallel if sharded else gradsync.DistributedDataParallel
    model = wrapper(net, **options, **({} if elastic else {"process_group": dist.group.WORLD}))
    if powersgd:  # torch's, rank 4, compressing from the third window: its state is what an elastic member keeps
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as hook
        model.register_comm_hook(hook.PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=2), hook.powerSGD_hook)
    acc = gradsync.GradientAccumulator(model, steps=2)
    inner = gradsync.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-4) if sharded else \
        torch.optim.SGD(model.parameters(), lr=1e-4)
    optimizer = acc.wrap_optimizer(inner)
    for _ in range((4 if powersgd else 3) * 2):  # PowerSGD: its first compressed window keeps an empty state
        with acc.accumulate():
            x = torch.randn(8, args.width, dtype=net[0].weight.dtype)
            acc.backward(model(x).float().square().mean())
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # .grad stays allocated: the steady state of a long run
    store = model.reducer.store
    record = {"config": args.config, "elastic": bool(model.reducer.attached), "params": sum(p.numel() for p in net.parameters()),
              "peak_mib": (status_kib("VmHWM") - base) / 1024, "state_mib": 0.0}
    if sharded:
        record.update(sharded_record(model, inner))
    else:
        in_buckets = {b.buffer.untyped_storage().data_ptr() for b in store.buckets}
        saved = model.reducer.launcher.saved or {}  # a stateful hook's state as the last synced backward began
        kept = [t for v in saved.values() if isinstance(v, dict) for t in v.values()]
        record.update(buckets_mib=nbytes(b.buffer for b in store.buckets) / MiB,
                      staged_mib=(nbytes(b.wire for b in store.buckets) + nbytes(kept)) / MiB,
                      grad_mib=nbytes(t for t in store.grad_tensors() if t.untyped_storage().data_ptr() not in in_buckets) / MiB)
    Path(args.out, f"{os.environ['GRADSYNC_REPLICA_ID']}.json").write_text(json.dumps(record))


def job(config: str, width: int, depth: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20))  # before the replicas' C library starts
        argv = [sys.executable, "-m", "gradsync.tools.cli", "run", "--replicas", "3", __file__, "--worker",
                "--config", config, "--width", str(width), "--depth", str(depth), "--out", out]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{config}: gradsync run failed:\n{done.stderr[-3000:]}")
        return [json.loads(p.read_text()) for p in sorted(Path(out).glob("*.json"))]


def table(rows: list[list[dict]]) -> str:
    lines = ["| configuration | follows membership | peak RSS above the model's start, MiB (3 replicas) | "
             "buckets (sharded: staging peak) MiB | kept for membership (staged copies; sharded: the mirrored shard, "
             "its state and copy) MiB | .grad apart (sharded: gradient shards) MiB | optimizer state MiB |",
             "|---|---|---|---|---|---|---|"]
    for replicas in rows:
        r = replicas[0]
        peaks = ", ".join(f"{x['peak_mib']:.0f}" for x in replicas)
        lines.append(f"| {r['config']} | {'yes' if r['elastic'] else 'no'} | {peaks} | {r['buckets_mib']:.1f} | "
                     f"{r['staged_mib']:.1f} | {r['grad_mib']:.1f} | {r['state_mib']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--config", default="fp32")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--only", action="append", choices=list(CONFIGS), help="run these rows only")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    width, depth = (256, 2) if args.quick else (args.width, args.depth)
    rows = [job(config, width, depth) for config in args.only or CONFIGS]
    text = table(rows)
    print(text)
    if args.quick:
        return
    info = machine_info()
    stem = record_stem("elastic-memory")
    params = rows[0][0]["params"]
    Path(args.out, f"{stem}.md").write_text(
        f"# Elastic membership: memory per rank\n\n`python benchmarks/elastic/memory.py`, {info.get('cpu', '')}: "
        f"{params / 1e6:.1f}M parameters, 3 replicas (`gradsync run`), windows of 2 micro-steps, plain SGD (sharded rows: "
        "`ShardedOptimizer(model, torch.optim.AdamW)`), "
        "`zero_grad(set_to_none=False)`. Peak RSS per replica above its RSS before the model was built (the model's "
        "parameters are in it); the other columns are the gradient memory the model holds, counted from its "
        "tensors.\n\n" + text + "\n\nThe staged copies are what an elastic model with gradient views or "
        "`reduce_dtype` adds: one copy of the gradients in the reduction dtype, so that a reduction that fails "
        "part-way leaves each member's window whole. Without those options `.grad` already lives apart from the "
        "buckets and elastic membership adds nothing. With a stateful comm hook (torch's PowerSGD) a member keeps a copy "
        "of the hook's state as each synced backward begins (its error feedback and warm starts), to put it back "
        "should the window be reduced again. A sharded elastic model keeps each shard on two members: "
        "the mirrored gradient shard, its AdamW state and its master copy (1/W of the model each), and the "
        "optimizer steps both shards.\n")
    print(f"wrote {Path(args.out, stem + '.md')}")


if __name__ == "__main__":
    main()
