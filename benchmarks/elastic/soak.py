"""Elastic soak: 3 replicas, 200+ windows, a SIGKILL of a random replica every ~10 windows; every victim rejoins.

    python benchmarks/elastic/soak.py                        # writes results/elastic-soak-<N>cpu-<date>.{md,json}
    python benchmarks/elastic/soak.py --samples 1200 --out /tmp/soak   # a short one
    python benchmarks/elastic/soak.py --namespaces           # root: two emulated machines (harness netns.link)

``gradsync run --replicas 3 --min-replicas 2 --max-restarts 100`` of this file (``--worker``).
The data is an ``ElasticSampler`` over a seeded dataset (2 micro-steps of 4 samples per member and
window), the optimizer AdamW. The kills follow a seeded schedule that every member computes the same
way: once all three are members again, 8-12 windows after the last join, a seeded replica dies at a
seeded point (forward, a ``no_sync`` backward, during the synced backward's reductions, after them,
or in the optimizer step). ``gradsync run`` restarts it; it joins at a window boundary. At the end the
driver checks that the members are bit-identical and equal (atol 1e-5) to one process trained on
exactly the micro-batches that were kept, that no sample was processed twice (every incarnation logs
what it processed), and that the sampler's report of lost samples is exactly what the dead held.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gradsync.tools.bench import netns
from gradsync.tools.bench.harness import RESULTS, machine_info, record_stem, write_record

SEED, STEPS, MICRO, REPLICAS = 5, 2, 4, 3
POINTS = ["forward", "local_backward", "during_reductions", "after_reductions", "optimizer_step"]


def build(torch):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 4))


def dataset(torch, n: int):
    g = torch.Generator().manual_seed(11)
    return torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g)


def optimizer_of(torch, params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def schedule(events: list, window: int, members: list[int], last_decided: int, full: int,
             allowed: tuple[int, int]) -> tuple[int, str] | None:
    """The kill of ``window`` (victim, point), the same on every member, or None: only with all ``full``
    members back, and only in ``allowed`` windows (not near the end, nor where the driver kills a machine)."""
    if len(members) < full or window <= last_decided + 1 or not allowed[0] <= window < allowed[1]:
        return None
    joins = [e.window for e in events if e.joined]
    since = max(joins, default=0)
    due = since + 8 + random.Random(SEED * 7919 + since).randint(0, 4)
    if window < due:
        return None
    rng = random.Random(SEED * 31 + window)
    return rng.choice(members), rng.choice(POINTS)


def worker(args: argparse.Namespace) -> None:
    started = time.time()
    import torch
    import torch.distributed as dist

    import gradsync
    from gradsync.elastic.membership import StoreMembership, membership as current_membership

    me, restart = int(os.environ["GRADSYNC_REPLICA_ID"]), int(os.environ["GRADSYNC_RESTART"])
    out = Path(args.out)
    gradsync.elastic.init_process_group("gloo", timeout=60)
    torch.set_num_threads(1)
    net = build(torch)
    model = gradsync.DistributedDataParallel(net)
    acc = gradsync.GradientAccumulator(model, steps=STEPS)
    optimizer = acc.wrap_optimizer(optimizer_of(torch, model.parameters()))
    xs, ys = dataset(torch, args.samples)
    sampler = gradsync.elastic.ElasticSampler(args.samples, micro_batch=MICRO, steps=STEPS, seed=SEED)
    log = open(out / f"processed-{me}-{restart}.jsonl", "w")
    step_log = open(out / f"steps-{me}-{restart}.jsonl", "w")  # every incarnation's optimizer steps
    record = {"replica": me, "restart": restart, "started": started, "steps": [], "first_step": None}
    plan = {"kill": None, "last_decided": -10}

    def die(point: str) -> None:
        (out / f"kill-{me}-{restart}.json").write_text(json.dumps({"time": time.time(), "point": point,
                                                                    "window": acc.windows - 1, "replica": me}))
        os.kill(os.getpid(), signal.SIGKILL)

    def at(point: str) -> bool:
        kill = plan["kill"]
        return kill is not None and kill[0] == me and kill[1] == point

    all_reduce, calls = dist.all_reduce, []

    def counted(*a, **k):
        if at("during_reductions") and acc.is_boundary:
            calls.append(1)
            if len(calls) == 3:  # after the header and the first bucket
                die("during_reductions")
        return all_reduce(*a, **k)
    dist.all_reduce = counted
    membership = StoreMembership
    commit = membership.commit
    membership.commit = lambda self, sync: die("after_reductions") if at("after_reductions") else commit(self, sync)

    for idx in sampler.iterate(acc):
        with acc.accumulate():
            w = acc.windows - 1
            if acc.micro_step == 0:
                time.sleep(args.sleep)  # stands for compute: a restart takes a few windows, not hundreds
                plan["kill"] = schedule(gradsync.elastic.events(), w, gradsync.elastic.members(), plan["last_decided"],
                                        int(os.environ["GRADSYNC_REPLICAS"]), tuple(args.allowed))
                if plan["kill"] is not None:
                    plan["last_decided"] = w
                if record["first_step"] is None:
                    record["first_step"] = time.time()
                if at("forward"):
                    die("forward")
            loss = torch.nn.functional.mse_loss(model(xs[idx]), ys[idx])
            if at("local_backward") and not acc.is_boundary:
                loss.register_hook(lambda g: die("local_backward"))
            acc.backward(loss)
            log.write(json.dumps([w, idx]) + "\n")
            log.flush()
            if acc.is_boundary and at("optimizer_step"):
                die("optimizer_step")
            optimizer.step()
            optimizer.zero_grad()
        if acc.is_boundary:
            record["steps"].append([w, time.time()])
            step_log.write(json.dumps([me, restart, w, time.time()]) + "\n")
            step_log.flush()
    m = current_membership()
    record.update(events=[e.__dict__ for e in gradsync.elastic.events()], members=gradsync.elastic.members(),
                  lost=sampler.lost, join_waits=m.join_waits, bytes_per_join=m.bytes_per_join, windows=acc.windows)
    torch.save({"params": [p.detach().clone() for p in net.parameters()], **record}, out / f"final-{me}.pt")


def reference(events: list[dict], samples: int, replicas: int = REPLICAS):
    """One process on every micro-batch dealt, less those a replica held in the window it left in."""
    import torch

    from gradsync.elastic import ElasticSampler
    net, (xs, ys) = build(torch), dataset(torch, samples)
    optimizer = optimizer_of(torch, net.parameters())
    lost, windows = [], 0
    for window, kept, gone in ElasticSampler(samples, micro_batch=MICRO, steps=STEPS, seed=SEED).replay(
            events, list(range(replicas))):
        lost += [(window, r, idx) for r, idx in gone]
        loss = sum(torch.nn.functional.mse_loss(net(xs[mb]), ys[mb]) for mb in kept) / len(kept)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        windows = window + 1
    return [p.detach() for p in net.parameters()], lost, windows


def verify(out: Path, samples: int, replicas: int = REPLICAS) -> dict:
    """Check the run; return its figures."""
    import torch
    finals = {int(f.stem.split("-")[1]): torch.load(f, weights_only=False) for f in out.glob("final-*.pt")}
    first = finals[min(finals)]
    identical = all(torch.equal(a, b) for r in finals.values() for a, b in zip(r["params"], first["params"]))
    same_events = all(r["events"] == first["events"] for r in finals.values())
    want, want_lost, windows = reference(first["events"], samples, replicas)
    diff = max(float((a - b).abs().max()) for a, b in zip(first["params"], want))
    processed = [i for f in out.glob("processed-*.jsonl") for line in f.read_text().splitlines()
                 for i in json.loads(line)[1]]
    kills = sorted((json.loads(f.read_text()) for f in out.glob("kill-*.json")), key=lambda k: k["time"])
    steps = [json.loads(line) for f in out.glob("steps-*.jsonl") for line in f.read_text().splitlines()]
    recovery = []
    for k in kills:  # the kill to the next optimizer step of any other replica
        after = [t for rid, _, _, t in steps if rid != k["replica"] and t > k["time"]]
        if after:
            recovery.append(min(after) - k["time"])
    events = first["events"]
    joins = [e for e in events if e["joined"]]
    join_waits = [x for r in finals.values() for x in r["join_waits"]]
    joined_at = [r["first_step"] - r["started"] for r in finals.values() if r["restart"] > 0]
    return {
        "members": first["members"], "windows": first["windows"], "reference_windows": windows,
        "identical": identical, "same_events": same_events, "max_abs_diff": diff,
        "processed": len(processed), "distinct_processed": len(set(processed)),
        "lost_matches": [tuple(x) for x in first["lost"]] == [tuple(x) for x in want_lost],
        "lost": [(w, r, len(idx)) for w, r, idx in first["lost"]],
        "kills": kills, "events": events, "recovery_s": recovery,
        "left_events_s": [e["seconds"] for e in events if e["left"]], "join_pause_s": [e["seconds"] for e in joins],
        "join_wait_s": join_waits, "restart_to_first_step_s": joined_at,
        "bytes_per_join": first["bytes_per_join"] or [b for r in finals.values() for b in r["bytes_per_join"]],
    }


def latest_window(work: Path) -> int:
    windows = [json.loads(line)[0] for f in work.glob("processed-*.jsonl") for line in f.read_text().splitlines()[-1:]]
    return max(windows, default=-1)


def namespace_soak(args: argparse.Namespace, work: Path) -> tuple[int, str, dict]:
    """Two launchers of 2 replicas in two namespaces; launcher B's namespace is killed whole at window
    ``--machine-kill`` and a new launcher there joins with new ids; replicas die and rejoin around it."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    kill_at = args.machine_kill
    worker_args = [__file__, "--worker", "--out", str(work), "--samples", str(args.samples), "--sleep",
                   str(args.sleep), "--allowed", str(kill_at + 30), str(args.samples // 32 - 25)]

    def launcher(net: netns.Link, i: int, tag: str) -> subprocess.Popen:
        cmd = net.exec(i, [sys.executable, "-m", "gradsync.tools.cli", "run", "--machines", "2", "--replicas", "2",
                           "--min-replicas", "2", "--max-restarts", "100", "--coordinator",
                           f"{net.addresses[0]}:{port}", *worker_args])
        env = {**os.environ, **net.env(i)}  # gloo's address: the namespace's veth
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(work / f"launcher-{tag}.log", "w"))

    with netns.link("gs-soak", "10.77.0") as net:
        a, b = launcher(net, 0, "a"), launcher(net, 1, "b")
        deadline = time.monotonic() + 1500
        while latest_window(work) < kill_at:
            if a.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the soak stopped before window {kill_at}; logs in {work}")
            time.sleep(0.05)
        machine = {"time": time.time(), "window": latest_window(work), "pids": net.kill(1)}
        b.wait()
        time.sleep(8)  # the survivors leave the dead machine out after its heartbeat stood still 5 s
        b2 = launcher(net, 1, "b2")  # a new machine there: its replicas get new ids and join
        a.wait(timeout=1500)
        b2.wait(timeout=60)
        log = "".join((work / f"launcher-{t}.log").read_text() for t in ("a", "b", "b2"))
        return (0 if a.returncode == 0 and b2.returncode == 0 else 1), log, machine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--samples", type=int, default=5400, help="dataset size: one epoch (24 samples a window with 3 members)")
    parser.add_argument("--sleep", type=float, default=0.25, help="seconds of stand-in compute per window")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", help="file name stem (default: elastic-soak[-namespaces]-<N>cpu-<date>)")
    parser.add_argument("--allowed", type=int, nargs=2, default=[0, 0], help=argparse.SUPPRESS)
    parser.add_argument("--machine-kill", type=int, default=40, help="with --namespaces: the window it happens")
    parser.add_argument("--namespaces", action="store_true",
                        help="two launchers in two network namespaces joined by a veth link; one is killed whole")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    work = Path(tempfile.mkdtemp(prefix="gradsync-soak-"))
    load_before, start, machine = os.getloadavg(), time.monotonic(), None
    if args.namespaces:
        code, log, machine = namespace_soak(args, work)
        replicas = 4
    else:
        cmd = [sys.executable, "-m", "gradsync.tools.cli", "run", "--replicas", str(REPLICAS), "--min-replicas",
               "2", "--max-restarts", "100", __file__, "--worker", "--out", str(work), "--samples",
               str(args.samples), "--sleep", str(args.sleep), "--allowed", "0", str(args.samples // 24 - 20)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        code, log, replicas = proc.returncode, proc.stderr, REPLICAS
    elapsed = time.monotonic() - start
    (work / "launcher.log").write_text(log)
    if code != 0:
        raise SystemExit(f"the soak failed ({code}); log in {work}/launcher.log:\n{log[-3000:]}")
    figures = verify(work, args.samples, replicas)
    args.name = args.name or record_stem("elastic-soak-namespaces" if args.namespaces else "elastic-soak")
    figures.update(seconds=elapsed, load_before=load_before, load_after=os.getloadavg(), samples=args.samples,
                   sleep=args.sleep, machine_kill=machine, replicas=replicas,
                   membership_lines=[line for line in log.splitlines() if line.startswith("gradsync.elastic")])
    write(args.out, args.name, figures)
    ok = (figures["identical"] and figures["same_events"] and figures["max_abs_diff"] <= 1e-5
          and figures["processed"] == figures["distinct_processed"] and figures["lost_matches"])
    print(f"{'passed' if ok else 'FAILED'}: {len(figures['kills'])} kills, {figures['windows']} windows; "
          f"{Path(args.out) / (args.name + '.md')}")
    if not ok:
        raise SystemExit(1)


def write(out: Path, name: str, f: dict) -> None:

    def spread(xs: list[float]) -> str:
        return f"median {statistics.median(xs):.3f} s, worst {max(xs):.3f} s" if xs else "none"
    machine = f.get("machine_kill")
    title = ("# Elastic soak on two emulated machines: 2 network namespaces joined by a veth link, 2 replicas in "
             "each; one machine killed whole" if machine else
             "# Elastic soak: 3 replicas, a SIGKILL every ~10 windows, every victim rejoins")
    lines = [
        title,
        "",
        f"`python benchmarks/elastic/soak.py`, {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, load "
        f"{f['load_before'][0]:.1f} before and {f['load_after'][0]:.1f} after; {f['seconds']:.0f} s in all. "
        f"{f['samples']} samples, one epoch, {f['windows']} windows ({STEPS} micro-steps of {MICRO} samples per "
        f"member and window, {f['sleep']} s of stand-in compute per window), AdamW.",
        "",
        f"- **Kills survived: {len(f['kills'])}** replicas, each at a seeded point"
        + (f", and one whole machine (its launcher and its replicas: {len(machine['pids'])} processes SIGKILLed "
           f"at window {machine['window']}; a new launcher there brought replicas with new ids that joined)"
           if machine else "") + f"; the run finished with members {f['members']}.",
        f"- Members bit-identical: **{f['identical']}**; the same events on every member: {f['same_events']}; largest "
        f"difference from one process trained on exactly what was kept: **{f['max_abs_diff']:.2e}** (atol 1e-5).",
        f"- Samples processed: {f['processed']}, distinct: {f['distinct_processed']} (no sample twice); the lost "
        f"samples the report lists are exactly what the dead replicas held: {f['lost_matches']}.",
        f"- Recovery, kill to the survivors' next optimizer step: {spread(f['recovery_s'])} (includes the rest of "
        f"the window's {f['sleep']} s of compute); re-forming alone: {spread(f['left_events_s'])}.",
        f"- Joins: {len(f['join_pause_s'])}; the members' pause to admit and send the state: "
        f"{spread(f['join_pause_s'])}; a joiner's wait from asking to admission: {spread(f['join_wait_s'])}; "
        f"restart to its first micro-step (a fresh Python importing torch): {spread(f['restart_to_first_step_s'])}.",
        f"- Bytes sent to each joiner: {sorted(set(f['bytes_per_join']))} (parameters and buffers, AdamW's "
        "moments, the accumulator, the sampler, the events).",
        "",
        "| kill | window | point | lost (window, replica, samples) |",
        "|---|---|---|---|",
    ]
    lost = {(w, r): n for w, r, n in f["lost"]}
    for i, k in enumerate(f["kills"]):
        victim_lost = [(w, r, n) for (w, r), n in lost.items() if w in (k["window"], k["window"] + 1)]
        lines.append(f"| {i} | {k['window']} | {k['point']} | {victim_lost} |")
    lines += ["", "Every lost micro-step, as the sampler reports it: " + ", ".join(
        f"window {w}: replica {r}, {n} samples" for w, r, n in f["lost"]) + ".", "",
        "The membership changes, as each member logged them (one line per change; shown once):", "", "```"]
    lines += sorted(set(f["membership_lines"]), key=f["membership_lines"].index) + ["```", ""]
    write_record(out, name, {"scenario": name, "machine": machine_info(), **f}, "\n".join(lines))


if __name__ == "__main__":
    main()
