"""Gloo's collectives on one 32 MB fp32 tensor, 2 ranks: what a sharded bucket (and deterministic=True) can use on CPU.

Prints (issue ms, issue-to-done ms) medians per rank, max over ranks, as a markdown table
(results/speed-gloo-collectives-*.md holds one run).

    python benchmarks/speed/gloo_collectives.py [numel] [world] [reps] [RATE]

With RATE (e.g. 2gbit; root) every rank runs in its own network namespace on one bridge, its veth limited to
RATE both ways (``gradsync.tools.bench.netns.star``), as ``deterministic.py --link``.
"""
import statistics
import sys
import time

import torch
import torch.distributed as dist

from gradsync.tools.bench import netns
from gradsync.tools.launch import run_ranks

LINK = None  # with RATE: (namespaces, devices), set before the ranks fork


class Works:
    def __init__(self, works):
        self.works = works

    def wait(self):
        for w in self.works:
            w.wait()


def pairwise_all_to_all(out, x, rank, world, s):
    """The all-to-all as W - 1 rounds, each with one peer each way (as a ring keeps one stream per direction):
    round k sends chunk (rank + k) to rank + k and receives rank - k's chunk for this rank. Blocks."""
    out[rank * s:(rank + 1) * s].copy_(x[rank * s:(rank + 1) * s])
    for k in range(1, world):
        to, frm = (rank + k) % world, (rank - k) % world
        ops = [dist.P2POp(dist.isend, x[to * s:(to + 1) * s], to), dist.P2POp(dist.irecv, out[frm * s:(frm + 1) * s], frm)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return Works([])


def halving_doubling(x, rank, world, scratch):
    """An all-reduce as recursive halving then doubling, one peer a round (log2 W rounds each way): at round d
    rank r keeps the half of its range its bit d picks, sends the other to r ^ d and adds r ^ d's part. Each
    element is summed in one binary tree over the ranks, ((a0 + a1) + (a2 + a3)), whatever the world size
    (a power of two). Blocks."""
    lo, hi, d, rounds = 0, x.numel(), 1, []
    while d < world:
        mid, peer = (lo + hi) // 2, rank ^ d
        keep, give = ((lo, mid), (mid, hi)) if not rank & d else ((mid, hi), (lo, mid))
        part = scratch[:keep[1] - keep[0]]
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, x[give[0]:give[1]], peer),
                                            dist.P2POp(dist.irecv, part, peer)]):
            work.wait()
        x[keep[0]:keep[1]].add_(part)
        rounds.append((peer, keep, give))
        (lo, hi), d = keep, d * 2
    for peer, keep, give in reversed(rounds):
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, x[keep[0]:keep[1]], peer),
                                            dist.P2POp(dist.irecv, x[give[0]:give[1]], peer)]):
            work.wait()
    return Works([])


def rank_fn(rank, world, n, reps):
    torch.set_num_threads(1)
    if LINK is not None:
        netns.regroup_in(LINK[0][rank], LINK[1][rank], rank, world)
    s = n // world
    x, out, full, a2a = torch.randn(n), torch.empty(s), torch.empty(n), torch.empty(n)
    scratch = torch.empty(n // 2)
    ops = {
        "all_reduce (reference)": lambda: dist.all_reduce(x, async_op=True),
        "reduce_scatter_single": lambda: dist.reduce_scatter_single(out, x, async_op=True),
        "all_to_all_single (sharded, CPU)": lambda: dist.all_to_all_single(a2a, x, async_op=True),
        "all-to-all as W - 1 pairwise rounds (blocking)": lambda: pairwise_all_to_all(a2a, x, rank, world, s),
        "reduce per owner": lambda: Works([dist.reduce(c, dst=j, async_op=True) for j, c in enumerate(x.split(s))]),
        **({"all-reduce as recursive halving and doubling (pairwise, blocking)": lambda: halving_doubling(
            x, rank, world, scratch)} if world & (world - 1) == 0 else {}),  # a peer rank ^ d exists: a power of two
        "all_gather_single": lambda: dist.all_gather_single(full, out, async_op=True),
        "all_gather_single in place": lambda: dist.all_gather_single(full, full[rank * s:(rank + 1) * s],
                                                                     async_op=True),
        "all_gather into a list of chunks": lambda: dist.all_gather(list(full.split(s)), out, async_op=True),
        "all_to_all_single of W copies of a chunk (a gather)": lambda: dist.all_to_all_single(
            full, a2a.view(world, s).copy_(out.expand(world, s)).view(-1), async_op=True),
        "broadcast per owner, in place (sharded, CPU)": lambda: Works(
            [dist.broadcast(c, src=j, async_op=True) for j, c in enumerate(full.split(s))]),
    }
    res = {k: ([], []) for k in ops}
    for _ in range(reps):
        for k, f in ops.items():
            dist.barrier()
            start = time.perf_counter()
            work = f()
            issued = time.perf_counter()
            work.wait()
            res[k][0].append(issued - start)
            res[k][1].append(time.perf_counter() - start)
    return {k: (1e3 * statistics.median(a), 1e3 * statistics.median(b)) for k, (a, b) in res.items()}


def main(argv: list[str] | None = None) -> list[str]:
    argv = sys.argv[1:] if argv is None else argv
    n = int(float(argv[0])) if argv else 8_000_000
    world = int(argv[1]) if len(argv) > 1 else 2
    reps = int(argv[2]) if len(argv) > 2 else 9
    if n % world:
        raise SystemExit(f"numel {n} is not a multiple of the world size {world}: the shards must be equal")
    global LINK
    if len(argv) > 3:
        with netns.star("gsglo", "10.79.3", world, rate=argv[3]) as net:
            LINK = (net.namespaces, net.devices)
            try:
                per_rank = run_ranks(rank_fn, world, n, reps, timeout=600)
            finally:
                LINK = None
    else:
        per_rank = run_ranks(rank_fn, world, n, reps, timeout=600)
    ref = max(r["all_reduce (reference)"][1] for r in per_rank)
    where = f", {argv[3]} veths" if len(argv) > 3 else ""
    lines = [f"| collective ({n * 4 / 1e6:.0f} MB fp32, {world} gloo ranks{where}) | issue ms | done ms | x all-reduce |",
             "|---|---|---|---|"]
    for k in per_rank[0]:
        issue, done = max(r[k][0] for r in per_rank), max(r[k][1] for r in per_rank)
        lines.append(f"| {k} | {issue:.1f} | {done:.1f} | {done / ref:.2f} |")
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
