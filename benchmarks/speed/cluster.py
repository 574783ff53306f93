"""Fast where communication really costs: 2 ranks on an emulated cluster link.

    python benchmarks/speed/cluster.py                       # results/speed-cluster-<N>cpu-<date>.{json,md} (root: ip netns, tc)
    python benchmarks/speed/cluster.py --name NAME-repeat    # a second run
    python benchmarks/speed/cluster.py --quick --out /tmp/c  # tiny models, a few windows: a smoke test

Each rank runs in its own network namespace; a veth pair joins them and a token-bucket qdisc
(``tc ... tbf rate 2gbit``) on both ends bounds what crosses it, as a NIC bounds a real cluster.
gloo binds the veth (``GLOO_SOCKET_IFNAME``); the rendezvous is a ``file://`` store both
namespaces see. The namespaces and the veth go away afterwards, also on an error, Ctrl-C or SIGTERM
(``gradsync.tools.bench.netns.link``).

Models over the link: ``device-8x1024``, whose 8 layers hold full-size 1024x1024 weights but whose
forward and backward are sleeps (2 ms and 4 ms a layer) around a cheap real gradient, so the CPU is
free while the "device" computes, as on a GPU host; and the CPU models ``gradsync bench`` uses
(mlp-8.4M, gpt-12M). On loopback (no link limit): ``many-801``, 200 blocks of Linear(64, 64) +
LayerNorm and a head, 801 tensors (per-parameter overhead).

Per model and accumulation, every variant runs one window (``accum`` micro-steps, ``no_sync`` on all
but the last, an AdamW step; SGD on the device-like model, whose optimizer would run on the device) per round, in a shuffled order each round, on identical model copies:
torch's DDP at its default (and a second copy of it: the A/A pair that states the noise), torch's
DDP at fixed caps of 1, 2, 4 and 8 MiB, gradsync (gradient views, default caps), gradsync with
``bucket_cap_mb="auto"`` (timed only after it chose), the same with ``bf16_wire_hook``, and gradsync with
``check_replicas=True`` (against plain gradsync: what the fingerprints cost where the link bounds the step); plus the
*compute* (the same window on a plain module, no communication) and one *all-reduce* of a flat
fp32 tensor the size of the whole gradient. The **limit** of a round is that round's compute
before the last micro-step + max(the last micro-step's compute, the all-reduce) + the optimizer step.
A window's time is the maximum over ranks. Ratios are paired: the median over rounds of
(variant / reference) in the same round.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gradsync.tools.bench import netns
from gradsync.tools.bench.emulated import spec_of
from gradsync.tools.bench.harness import RESULTS, LoadWatch, machine_info, record_stem, write_record

TORCH_CAPS = (1.0, 2.0, 4.0, 8.0)  # torch's DDP at fixed caps besides its default 25 MiB
LINK_MODELS, LOOP_MODELS = ["device-8x1024", "mlp-8.4M", "gpt-12M"], ["many-801"]
QUICK_LINK, QUICK_LOOP = ["device-tiny"], ["many-tiny"]


# ---------------------------------------------------------------- timing (worker side)
def variants(quick: bool) -> dict:
    import gradsync
    from gradsync.tools.bench.models import GradsyncEngine, TorchEngine
    kw = dict(set_to_none=True, lr=1e-4)

    class Checked(GradsyncEngine):  # what check_replicas=True costs where the link bounds the step
        def wrap(self, module, bucket_cap_mb, view):
            return gradsync.DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=view,
                                                    check_replicas=True)

    def wire(m):
        e = GradsyncEngine(m, bucket_cap_mb="auto", view=True, **kw)
        e.model.register_comm_hook(None, gradsync.bf16_wire_hook)
        return e

    out = {"torch": lambda m: TorchEngine(m, bucket_cap_mb=25.0, view=False, **kw),
           "torch A/A": lambda m: TorchEngine(m, bucket_cap_mb=25.0, view=False, **kw)}
    for cap in TORCH_CAPS[-1:] if quick else TORCH_CAPS:
        out[f"torch {cap:g} MiB"] = lambda m, cap=cap: TorchEngine(m, bucket_cap_mb=cap, view=False, **kw)
    out["gradsync"] = lambda m: GradsyncEngine(m, bucket_cap_mb=25.0, view=True, **kw)
    out["gradsync check_replicas"] = lambda m: Checked(m, bucket_cap_mb=25.0, view=True, **kw)
    out["gradsync auto"] = lambda m: GradsyncEngine(m, bucket_cap_mb="auto", view=True, **kw)
    out["gradsync auto bf16_wire"] = wire
    return out


class Compute:
    """The window on a plain module: no communication; times its parts."""

    def __init__(self, module):
        import torch
        self.model = module
        self.opt = torch.optim.AdamW(module.parameters(), lr=1e-4)

    def window(self, spec, rank: int, step: int, accum: int) -> list[float]:
        from gradsync.tools.bench.models import loss_fn
        marks = [time.perf_counter()]
        for k in range(accum):
            x, y = spec.batch_for(rank, step * accum + k)
            loss_fn(self.model(x), y).backward()
            marks.append(time.perf_counter())
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        end = time.perf_counter()
        return [marks[-2] - marks[0], marks[-1] - marks[-2], end - marks[-1]]  # before last, last, optimizer


def time_cell(rank: int, spec, accum: int, warmup: int, reps: int, quick: bool, trace_dir: str | None) -> dict:
    import torch
    import torch.distributed as dist
    from gradsync.tools.bench.harness import reduce_max, round_order, run_window

    base = spec.build(seed=0)
    engines = {name: make(copy.deepcopy(base)) for name, make in variants(quick).items()}
    compute = Compute(copy.deepcopy(base))
    if getattr(spec, "kind", "") == "device":  # a device's optimizer step is short: SGD keeps the CPU's short
        for e in [*engines.values(), compute]:
            e.opt = torch.optim.SGD(e.model.parameters(), lr=1e-4)
    numel = sum(p.numel() for p in base.parameters())
    flat = torch.ones(numel)
    names = [*engines, "compute", "all-reduce"]
    times = {n: [] for n in names}
    parts = []  # the compute's (before last, last, optimizer) per timed round

    def one(name: str, rep: int) -> list[float]:
        dist.barrier()
        start = time.perf_counter()
        extra = []
        if name == "compute":
            extra = compute.window(spec, rank, rep, accum)
        elif name == "all-reduce":
            dist.all_reduce(flat)
        else:
            run_window(engines[name], spec, rank, rep, accum)
        return reduce_max([time.perf_counter() - start, *extra])

    autos = [n for n in engines if "auto" in n]
    settle = 0
    for rep in range(warmup):
        for name in round_order(names, rep):
            one(name, rep)
    while reduce_max([float(any(engines[n].model.bucket_choice is None for n in autos))])[0]:
        settle += 1  # "auto" times its candidates: only its windows run until it chose
        for name in autos:
            one(name, warmup + settle)
    for rep in range(warmup + settle, warmup + settle + reps):
        for name in round_order(names, rep):
            got = one(name, rep)
            times[name].append(got[0])
            if name == "compute":
                parts.append(got[1:])
    trace = None
    if trace_dir:  # one traced window of gradsync auto, outside the timing
        model = engines["gradsync auto"].model
        model.enable_comm_trace()
        run_window(engines["gradsync auto"], spec, rank, 10 ** 6, accum)
        trace = str(Path(trace_dir) / f"cluster-{spec.name}-acc{accum}.trace.json")
        model.export_trace(trace)
        record = model.comm_trace[-1]
        trace = {"file": trace, "backward_ms": 1e3 * (record["backward_end"] - record["backward_start"]),
                 "buckets": [{"index": b["index"], "mb": b["bytes"] / 2 ** 20,
                              **{k: 1e3 * (b[k] - record["backward_start"]) for k in ("ready", "launch", "done")
                                 if k in b}} for b in record["buckets"]]}
        model.reducer.enable_trace(False)
    limit = [pre + max(last, ar) + opt for (pre, last, opt), ar in zip(parts, times["all-reduce"])]
    choice = {n: engines[n].model.bucket_choice for n in autos}
    return {"times": times, "limit": limit, "parts": parts, "settle_windows": settle, "choice": choice,
            "buckets": {n: len(engines[n].model.reducer.store.buckets) for n in engines if n.startswith("gradsync")},
            "numel": numel, "trace": trace}


def worker(a: argparse.Namespace) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{a.store}", rank=a.rank, world_size=2,
                            timeout=datetime.timedelta(seconds=600))
    rows = []
    for name in a.models:
        for accum in a.accum:
            got = time_cell(a.rank, spec_of(name), accum, a.warmup, a.reps, a.quick, a.trace_dir)
            rows.append({"model": name, "accum": accum, "link": a.link, **got})
            if a.rank == 0:
                print(f"{a.link} {name} accum {accum}: " + ", ".join(
                    f"{n} {1e3 * statistics.median(t):.1f}" for n, t in got["times"].items()), flush=True)
    dist.barrier()
    if a.rank == 0:
        Path(a.result).write_text(json.dumps(rows))
    dist.destroy_process_group()


# ---------------------------------------------------------------- driver
def run_pair(models: list[str], args: argparse.Namespace, namespaces: bool, work: Path) -> list[dict]:
    """Two worker processes (in the namespaces, or on loopback); return rank 0's rows."""
    link = f"veth, tbf {args.rate}" if namespaces else "loopback"
    tag = "ns" if namespaces else "lo"
    store, result = work / f"store-{tag}", work / f"rows-{tag}.json"
    procs = []
    with contextlib.ExitStack() as stack:
        net = stack.enter_context(netns.link("gs-clu", "10.78.0", rate=args.rate)) if namespaces else None
        stack.callback(stop, procs)
        for rank in range(2):
            cmd = [sys.executable, __file__, "--worker", "--rank", str(rank), "--store", str(store), "--result",
                   str(result), "--link", link, "--reps", str(args.reps), "--warmup", str(args.warmup),
                   "--accum", *map(str, args.accum), "--models", *models] + (["--quick"] if args.quick else []) \
                + (["--trace-dir", str(args.out)] if args.trace else [])
            env = {**os.environ, **(net.env(rank) if net else {"GLOO_SOCKET_IFNAME": "lo"}),
                   "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2] / "src"),
                                                  os.environ.get("PYTHONPATH", "")])}
            procs.append(subprocess.Popen(net.exec(rank, cmd) if net else cmd, env=env))
        deadline = time.monotonic() + args.timeout
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.returncode not in (None, 0) for p in procs):
                raise SystemExit(f"cluster: a worker failed or timed out ({[p.returncode for p in procs]})")
            time.sleep(0.2)
        return json.loads(result.read_text())


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def summarize(row: dict) -> dict:
    t = row["times"]

    def ratio(a, b):
        return statistics.median(x / y for x, y in zip(a, b))

    torch_caps = {n: statistics.median(v) for n, v in t.items() if n == "torch" or n.endswith("MiB")}
    best = min(torch_caps, key=torch_caps.get)
    auto = t["gradsync auto"]
    return {"median_ms": {n: 1e3 * statistics.median(v) for n, v in t.items()},
            "limit_ms": 1e3 * statistics.median(row["limit"]),
            "torch_best": best,
            "ratio": {"gradsync / torch": ratio(t["gradsync"], t["torch"]),
                      "auto / torch": ratio(auto, t["torch"]),
                      "auto / torch best": ratio(auto, t[best]),
                      "auto / limit": ratio(auto, row["limit"]),
                      "bf16_wire / auto": ratio(t["gradsync auto bf16_wire"], auto),
                      "check_replicas / gradsync": ratio(t["gradsync check_replicas"], t["gradsync"]),
                      "torch best / torch": ratio(t[best], t["torch"]),
                      "torch / limit": ratio(t["torch"], row["limit"]),
                      "A/A": ratio(t["torch A/A"], t["torch"])},
            "noise_ms": 1e3 * statistics.median(abs(a - b) for a, b in zip(t["torch"], t["torch A/A"])),
            "link_gbit_s": 8 * 4 * row["numel"] / statistics.median(t["all-reduce"]) / 1e9}


def report(record: dict) -> str:
    lines = [f"# {record['name']}: gradsync on an emulated cluster link", "",
             f"2 ranks, each in its own network namespace, joined by a veth pair with `tc qdisc tbf rate "
             f"{record['rate']}` on both ends ({'used' if record['namespaces'] else 'NOT available: loopback instead'}); "
             f"{record['machine']['cpu']} ({record['machine']['cores']} cores), torch {record['torch']}, "
             f"{record['reps']} timed rounds after {record['warmup']} warm-up rounds (and gradsync auto's own until "
             f"it chose), every variant one window a round in a shuffled order; load average "
             f"{record['load_before'][0]:.2f} before, {record['load_after'][0]:.2f} after; {record['seconds']:.0f} s.",
             "",
             "Paired ratios (median over rounds of variant / reference in the same round). *limit* = compute "
             "before the last micro-step + max(last micro-step's compute, one all-reduce of the whole gradient) "
             "+ the optimizer step, all measured in the same round. A/A = torch's DDP against a second copy of "
             "itself (the noise); *link* = the whole-gradient all-reduce's algorithm bandwidth (gradient bytes / time).",
             "",
             "| model | link | accum | torch ms | limit ms | gradsync / torch | auto / torch | auto / torch best "
             "(cap) | auto / limit | bf16_wire / auto | check_replicas / gradsync | A/A | auto chose | link Gbit/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in record["rows"]:
        s, c = r["summary"], r["choice"].get("gradsync auto")
        chose = "-" if c is None else f"{c['bucket_cap_mb']:g} MiB / first {c['first_bucket_cap_mb']:g}"
        q = s["ratio"]
        lines.append(
            f"| {r['model']} | {r['link']} | {r['accum']} | {s['median_ms']['torch']:.1f} | {s['limit_ms']:.1f} | "
            f"{q['gradsync / torch']:.3f} | {q['auto / torch']:.3f} | {q['auto / torch best']:.3f} "
            f"({s['torch_best'].replace('torch', '').strip() or '25 MiB'}) | {q['auto / limit']:.3f} | "
            f"{q['bf16_wire / auto']:.3f} | {q['check_replicas / gradsync']:.3f} | {q['A/A']:.3f} | {chose} | "
            f"{s['link_gbit_s']:.2f} |")
    lines += ["", "Median window (ms) of every variant:", ""]
    names = list(record["rows"][0]["summary"]["median_ms"])
    lines += ["| model | accum | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for r in record["rows"]:
        lines.append(f"| {r['model']} | {r['accum']} | " + " | ".join(
            f"{r['summary']['median_ms'][n]:.1f}" for n in names) + " |")
    lines += ["", "What `bucket_cap_mb=\"auto\"` saw and chose (rank 0; the same numbers on every rank): the link "
              "fitted to its own all-reduces, the predicted end of communication per candidate cap (ms after the "
              "first gradient), and each cap's median timed synced backward (ms):", ""]
    for r in record["rows"]:
        c = r["choice"].get("gradsync auto")
        if c is None:
            continue
        link = c.get("link") or {}
        fit = (f"latency {link['latency_ms']:.2f} ms, {link['gbytes_s']:.3f} GB/s, whole gradient {link['link_ms']:.0f} "
               f"ms against a gradient span of {link['span_ms']:.0f} ms; predicted " + ", ".join(
                   f"{float(k):g} MiB {v:.0f}" for k, v in link["predicted_ms"].items()) + "; ") if link else ""
        lines.append(f"- {r['model']} accum {r['accum']}: {c.get('rule', 'timed')} -> {c['bucket_cap_mb']:g} MiB; {fit}"
                     "timed " + (", ".join(f"{float(k):g} MiB {v:.0f}" for k, v in c["measured_ms"].items()) or "nothing"))
    traced = [r for r in record["rows"] if r.get("trace")]
    if traced:
        lines += ["", "One traced window of gradsync auto per cell (ms after its synced backward's first "
                  "gradient; rank 0): bucket MB ready / launch / done", ""]
        for r in traced:
            tr = r["trace"]
            lines.append(f"- {r['model']} accum {r['accum']} (backward {tr['backward_ms']:.1f}): " + "; ".join(
                f"{b['mb']:.1f} MB {b.get('ready', 0):.1f}/{b.get('launch', 0):.1f}/{b.get('done', 0):.1f}"
                for b in tr["buckets"]))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--link", default="", help=argparse.SUPPRESS)
    p.add_argument("--trace-dir", help=argparse.SUPPRESS)
    p.add_argument("--models", nargs="+", help="models over the link (default: device-8x1024 mlp-8.4M gpt-12M)")
    p.add_argument("--loop-models", nargs="*", help="models on loopback (default: many-801)")
    p.add_argument("--accum", type=int, nargs="+", default=[1, 4])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rate", default="2gbit")
    p.add_argument("--no-netns", action="store_true", help="everything on loopback")
    p.add_argument("--trace", action="store_true", help="write a Chrome trace of gradsync auto per cell")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--name", help="file name stem (default: speed-cluster-<N>cpu-<date>)")
    p.add_argument("--quick", action="store_true", help="tiny models, 2 rounds: a smoke test, not a measurement")
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return {}
    if args.quick:
        args.reps, args.warmup = 2, 1
    link_models = args.models or (QUICK_LINK if args.quick else LINK_MODELS)
    loop_models = args.loop_models if args.loop_models is not None else (QUICK_LOOP if args.quick else LOOP_MODELS)
    namespaces = not args.no_netns and netns.available()
    args.name = args.name or record_stem("speed-cluster", args.quick)
    with LoadWatch() as load, tempfile.TemporaryDirectory(prefix="gradsync-cluster-") as work:
        rows = (run_pair(link_models, args, namespaces, Path(work)) if link_models else []) + \
               (run_pair(loop_models, args, False, Path(work)) if loop_models else [])
    for r in rows:
        r["summary"] = summarize(r)
    import torch
    record = {"scenario": "speed-cluster", "name": args.name, "machine": machine_info(), "torch": torch.__version__,
              "rate": args.rate, "namespaces": namespaces, "netns_prefix": "gs-clu", "netns_tag": str(os.getpid()), "reps": args.reps,
              "warmup": args.warmup, **load.as_record(), "quick": args.quick, "rows": rows}
    write_record(args.out, args.name, record, report(record))
    return record


if __name__ == "__main__":
    main()
