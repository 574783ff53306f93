"""``gradsync demo --elastic``: a replica is SIGKILLed mid-run, the job goes on, the replica rejoins.

    gradsync demo --elastic               # 3 replicas under `gradsync run`, replica 2 killed at window 15

The spiral classifier of ``gradsync demo`` trains under ``gradsync run --replicas 3 --min-replicas 2
--max-restarts 1``, its data dealt by ``gradsync.elastic.ElasticSampler`` (a constant global batch
of 96 points a window). Replica 2 SIGKILLs itself in a window's synced backward; the survivors
finish that window over what they processed, the launcher restarts the replica, and it joins at a
window boundary. The summary prints the membership changes, checks the final parameters against one
process trained on exactly the micro-batches that were kept, and the loss curve marks each change.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from gradsync.tools.demo import accuracy, make_model, spirals  # absolute: gradsync run runs this file as a script

SAMPLES, MICRO, GLOBAL, STEPS, LR, KILL_AT = 7680, 16, 96, 2, 1e-2, 15


def worker(out: Path) -> None:
    import gradsync
    me, restart = int(os.environ["GRADSYNC_REPLICA_ID"]), int(os.environ["GRADSYNC_RESTART"])
    gradsync.elastic.init_process_group("gloo")
    torch.set_num_threads(1)
    model = gradsync.DistributedDataParallel(make_model())
    acc = gradsync.GradientAccumulator(model, steps=STEPS)
    optimizer = acc.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=LR))
    x, y = spirals(SAMPLES)
    x = x.double()
    sampler = gradsync.elastic.ElasticSampler(SAMPLES, micro_batch=MICRO, global_batch=GLOBAL, seed=0)
    losses, gave_up = [], False
    if restart > 0:  # about to ask to join (at the sampler's first item): tell the members to wait for it
        (out / f"rejoining-{me}").touch()
    for idx in sampler.iterate(acc):
        with acc.accumulate():
            window = acc.windows - 1
            loss = F.cross_entropy(model(x[idx]), y[idx])
            if me == 2 and restart == 0 and window == KILL_AT and acc.is_boundary:
                loss.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL))  # in its synced backward
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append((window, loss.item()))
        if window > KILL_AT and len(gradsync.elastic.members()) < 3 and not gave_up:
            gave_up = not wait_for_rejoin(out)
    events = [e.__dict__ for e in gradsync.elastic.events()]
    torch.save({"params": [p.detach().clone() for p in model.module.parameters()], "losses": losses,
                "events": events, "members": gradsync.elastic.members(), "lost": sampler.lost,
                "accuracy": accuracy(model.module)}, out / f"replica-{me}.pt")


def wait_for_rejoin(out: Path, timeout: float = 300.0) -> bool:
    """On a survivor, until the killed replica is back: wait for its restart to reach its first window
    (however long starting an interpreter takes on a busy machine), then take slower steps, so that the
    job cannot end before its join request is admitted at a window boundary. False: it never came."""
    deadline = time.monotonic() + timeout
    while not (out / "rejoining-2").exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    time.sleep(0.05)
    return True


def reference(events: list[dict]) -> list[torch.Tensor]:
    """One process on every micro-batch dealt, less those a replica held in the window it left in."""
    from gradsync.elastic import ElasticSampler
    net = make_model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR)
    x, y = spirals(SAMPLES)
    x = x.double()
    sampler = ElasticSampler(SAMPLES, micro_batch=MICRO, global_batch=GLOBAL, seed=0)
    for _, kept, _ in sampler.replay(events, [0, 1, 2]):
        loss = sum(F.cross_entropy(net(x[mb]), y[mb]) for mb in kept) / len(kept)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return [p.detach() for p in net.parameters()]


def main(out_dir: str = "demo-output") -> None:
    with tempfile.TemporaryDirectory(prefix="gradsync-demo-") as work:  # the replicas' results: removed after
        run_and_check(Path(work), Path(out_dir))


def run_and_check(work: Path, out_dir: Path) -> None:
    print(f"gradsync run --replicas 3 --min-replicas 2 --max-restarts 1: {SAMPLES} spiral points, "
          f"{GLOBAL} a window; replica 2 is SIGKILLed in window {KILL_AT}")
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "gradsync.tools.cli", "run", "--replicas", "3", "--min-replicas", "2",
           "--max-restarts", "1", __file__, "--worker", str(work)]
    proc = subprocess.run(cmd, stderr=subprocess.PIPE, text=True, timeout=600)
    for line in dict.fromkeys(proc.stderr.splitlines()):  # each member logs each change: show it once
        if line.startswith(("gradsync run:", "gradsync.elastic:")):
            print("  " + line)
    if proc.returncode != 0:
        raise SystemExit(f"the elastic run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    results = {int(f.stem.split("-")[1]): torch.load(f, weights_only=False) for f in work.glob("replica-*.pt")}
    first = results[min(results)]
    identical = all(torch.equal(a, b) for r in results.values() for a, b in zip(r["params"], first["params"]))
    diff = max(float((a - b).abs().max()) for a, b in zip(first["params"], reference(first["events"])))
    print(f"  finished in {time.perf_counter() - start:.0f} s with members {first['members']}; "
          f"held-out accuracy {first['accuracy']:.3f}")
    print(f"  lost with the dead replica: {[(w, r, len(s)) for w, r, s in first['lost']]} (window, replica, samples)")
    print(f"  members bit-identical: {identical}; largest difference from one process trained on what was "
          f"kept: {diff:.1e}")
    plot(first, out_dir)
    if not identical or diff > 1e-4:
        raise SystemExit("the members disagree, or differ from the reference")


def plot(result: dict, out: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  (loss curve skipped: matplotlib is not installed)")
        return
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    windows: dict[int, list[float]] = {}
    for w, loss in result["losses"]:
        windows.setdefault(w, []).append(loss)
    ax.plot(list(windows), [sum(v) / len(v) for v in windows.values()], label="training loss (a member's micro-batches)")
    for e in result["events"]:
        what = f"{e['left']} left" if e["left"] else f"{e['joined']} joined"
        ax.axvline(e["window"], color="tab:red" if e["left"] else "tab:green", linestyle="--", label=f"replica {what}")
    ax.set(xlabel="window (optimizer step)", ylabel="cross-entropy", yscale="log",
           title="gradsync demo --elastic: a replica dies and rejoins")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "elastic-loss.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"  loss curve      {path}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(Path(sys.argv[2]))
    else:
        main()
