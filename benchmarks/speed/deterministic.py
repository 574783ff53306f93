"""What ``deterministic=True`` costs per window: the same ranks, windows alternating, against the default reduction.

    python benchmarks/speed/deterministic.py                 # results/speed-deterministic-<N>cpu-<date>.{json,md}
    python benchmarks/speed/deterministic.py --quick --out /tmp   # a smoke test
    python benchmarks/speed/deterministic.py --world 4 --link 2gbit  # ...-link-...: each rank behind its own 2 gbit NIC (root)

gradsync's DDP (no gradient views: ``deterministic=True`` refuses them) three times on identical model copies:
``default`` (bucketed all-reduce, micro-steps added into ``.grad``), ``default A/A`` (a second copy: the noise)
and ``deterministic`` (each micro-step's gradient kept in a binary tree, each bucket all-to-all, summed in
rank order, all-gathered). Each round runs one window of each in a shuffled order; a window's time is the
maximum over ranks, ratios are paired round by round. Accumulation 4 keeps four micro-steps apart in the tree.
Bytes on the wire per window are those of a ring all-reduce by construction (``docs/deterministic.md``).

With ``--link RATE`` every rank runs in its own network namespace, joined to the others by a veth on one bridge,
each veth limited to RATE both ways by ``tc`` (``gradsync.tools.bench.netns.star``): a cluster whose NICs bound
what crosses them. The models are then the device-like one of ``cluster.py`` (its compute sleeps: the CPU stays
free for the collectives, as on a GPU host) and mlp-8.4M.
"""
from __future__ import annotations

import argparse
import sys

import gradsync
from gradsync.tools.bench import netns
from gradsync.tools.bench.emulated import spec_of
from gradsync.tools.bench.harness import paired, paired_report, run_paired_benchmark, time_variants, with_aa
from gradsync.tools.bench.models import GradsyncEngine, ModelSpec

MODELS = [ModelSpec(name="mlp-8.4M", kind="mlp", width=1024, depth=8, batch=32),
          ModelSpec(name="gpt-12M", kind="gpt", width=384, depth=6, batch=2, seq=64)]


LINK_MODELS = ["device-8x1024", "mlp-8.4M"]
LINK: dict | None = None  # --link: set before the ranks fork, so each finds its namespace and device here


class Deterministic(GradsyncEngine):
    name = "deterministic"

    def wrap(self, module, bucket_cap_mb, view):
        return gradsync.DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb, deterministic=True)


def time_rank(rank, world, spec, accum, warmup, reps) -> dict:
    if LINK is not None:
        netns.regroup_in(LINK["namespaces"][rank], LINK["devices"][rank], rank, world)
    kw = dict(bucket_cap_mb=25.0, view=False, set_to_none=True, lr=1e-3)
    variants = with_aa({"default": lambda m: GradsyncEngine(m, **kw),
                        "deterministic": lambda m: Deterministic(m, **kw)}, "default")
    return time_variants(rank, world, spec, variants, accum, warmup, reps)


def summarize(times: dict) -> dict:
    return paired(times, "default")


def report(record: dict) -> str:
    where = "" if LINK is None else f", each rank in its own network namespace behind a {LINK['rate']} veth (tbf both ways)"
    return paired_report("deterministic=True: cost per optimizer window", record, ", no gradient views" + where,
                         "default", "deterministic")


def main(argv: list[str] | None = None) -> dict:
    global LINK
    quick = [ModelSpec(name="mlp-tiny", kind="mlp", width=32, depth=2, batch=4)]
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--link", help="e.g. 2gbit: every rank behind its own NIC of this rate (root: ip netns, tc)")
    extra.add_argument("--world", type=int, default=2)
    known, rest = extra.parse_known_args(sys.argv[1:] if argv is None else argv)
    rest += ["--world", str(known.world)]
    if not known.link:
        return run_paired_benchmark("speed-deterministic", __doc__, MODELS, quick, time_rank, summarize, report, rest)
    with netns.star("gsdet", "10.79.0", known.world, rate=known.link) as net:
        LINK = {"namespaces": net.namespaces, "devices": net.devices, "rate": known.link}
        try:
            return run_paired_benchmark("speed-deterministic-link", __doc__, [spec_of(m) for m in LINK_MODELS],
                                        [spec_of("device-tiny")], time_rank, summarize, report, rest)
        finally:
            LINK = None


if __name__ == "__main__":
    main()
