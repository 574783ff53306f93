"""Before/after a change to the engine, in one run (issue 24): the baseline commit's gradsync against the
working tree's, window by window on the same ranks, with an A/A pair (baseline against itself) as the noise.

The baseline's ``src/gradsync`` (without its tools; its imports are relative) is exported with ``git archive``
and imported as ``gradsync_base`` next to the working tree's ``gradsync``, in the same forked gloo ranks.
Three groups, each timed in its own ranks on identical model copies, data and AdamW:

- ``ddp``: torch's DDP (defaults, the reference of ``gradsync bench``), ``before``, ``before-again``
  (a second baseline instance: the A/A pair) and ``after`` -- gradsync's DDP with gradient views;
- ``sharded``: torch's DDP, ``ShardedDataParallel`` + ``ShardedOptimizer`` before, before-again, after;
- ``acc``: torch's DDP, and gradsync's DDP driven by ``GradientAccumulator`` with ``num_items`` (what
  the window carries in its phase header, and the skip bookkeeping of issue 25) before, before-again, after.

The order of a group's engines is shuffled every round (seeded by the round, the same on every rank), a
window's time is the maximum over ranks, and ratios are paired round by round. Models: ``gradsync bench``'s
(mlp-8.4M, gpt-12M) and its model of 194 tiny parameters, where per-parameter bookkeeping dominates.

    python benchmarks/speed/before_after.py [--base 7a4ad5f] [--reps 11] [--runs 2] [--wait-load 1.5]
        # -> results/speed-before-after-<N>cpu-<date>.{json,md}; about 5 minutes on 2 idle cores (plus any waiting)
    python benchmarks/speed/before_after.py --models gpt-12M --accum 4 --reps 31 --runs 1 --name NAME  # one row
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import gradsync
from gradsync.tools.bench.harness import RESULTS, machine_info, quartiles, record_stem, reduce_max, write_record
from gradsync.tools.bench.measure import alternate
from gradsync.tools.bench.models import Engine, ModelSpec, TorchEngine
from gradsync.tools.bench.run import full_plan, quick_plan
from gradsync.tools.launch import import_before_forking, run_ranks

ROOT = Path(__file__).resolve().parents[2]
PACKAGES: dict[str, object] = {"after": gradsync}  # "before": gradsync_base, once exported
SHARED_LOAD = 3.0  # a row whose 1-min load peaked above this shared the 2 cores with other jobs
GROUPS = {"ddp": ["torch", "before", "before-again", "after"],
          "sharded": ["torch", "sharded-before", "sharded-before-again", "sharded-after"],
          # GradientAccumulator with num_items (summed losses): the window's carried header values
          "acc": ["torch", "acc-before", "acc-before-again", "acc-after"]}


def bench_models(quick: bool) -> list[ModelSpec]:
    """``gradsync bench``'s timed models, and its many-tiny-parameters model (``measure.overhead_rank``)."""
    args = argparse.Namespace(models=None, accum=None, params=[], warmup=0, reps=0, bucket_cap_mb=25.0)
    if quick:
        return quick_plan(args).models[:1] + [ModelSpec(name="tiny-params-18", kind="mlp", width=8, depth=8, batch=4)]
    return full_plan(args).models + [ModelSpec(name="tiny-params-194", kind="mlp", width=8, depth=96, batch=4)]


def export_base(commit: str) -> tuple[object, str]:
    """Import ``commit``'s ``src/gradsync`` (without its tools) as ``gradsync_base``; return it and its dir."""
    root = tempfile.mkdtemp(prefix="gradsync-base-")
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "src/gradsync"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", root], input=archive, check=True)
    pkg = Path(root) / "gradsync_base"
    shutil.copytree(Path(root) / "src" / "gradsync", pkg, ignore=shutil.ignore_patterns("tools", "__pycache__"))
    sys.path.insert(0, root)
    import gradsync_base  # noqa: PLC0415
    return gradsync_base, root


def code_state(base_dir: Path) -> dict:
    """Which modules differ between the baseline and the working tree, and a hash of the tree's code."""
    def files(top: Path) -> dict[str, bytes]:
        return {str(p.relative_to(top)): p.read_bytes() for p in sorted(top.rglob("*.py"))
                if "tools" not in p.relative_to(top).parts and "__pycache__" not in p.parts}
    new, old = files(Path(gradsync.__file__).parent), files(base_dir)
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(git + ["status", "--porcelain", "src/gradsync"], capture_output=True,
                                text=True).stdout.strip())
    return {"after_file": gradsync.__file__, "before_file": str(base_dir / "__init__.py"), "head": head, "dirty": dirty,
            "tree_sha256": hashlib.sha256(b"".join(k.encode() + v for k, v in sorted(new.items()))).hexdigest()[:12],
            "only_before": sorted(set(old) - set(new)), "only_after": sorted(set(new) - set(old)),
            "changed": sorted(k for k in set(old) & set(new) if old[k] != new[k])}


def make_engine(name: str, module):
    kw = dict(bucket_cap_mb=25.0, view=None, set_to_none=True, lr=1e-3)
    if name == "torch":
        return TorchEngine(module, **kw)
    sharded, accumulated = name.startswith("sharded-"), name.startswith("acc-")
    pkg = PACKAGES["after" if name.endswith("after") else "before"]

    class Versioned(Engine):
        view = True  # gradsync's recommended setting, as in gradsync bench

        def wrap(self, module, bucket_cap_mb, view):
            if sharded:
                return pkg.ShardedDataParallel(module, bucket_cap_mb=bucket_cap_mb)
            return pkg.DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=view)

        def make_optimizer(self, lr):
            if sharded:
                return pkg.ShardedOptimizer(self.model, torch.optim.AdamW, lr=lr)
            return super().make_optimizer(lr)

        def micro_step(self, x, y, sync, probe=None):
            if not accumulated:
                return super().micro_step(x, y, sync)
            acc = self.__dict__.get("acc")
            if acc is None or acc.steps != self.accum:
                acc = self.acc = pkg.GradientAccumulator(self.model, steps=self.accum)
            with acc.accumulate():
                out = self.model(x)
                acc.backward(F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="sum"),
                             num_items=y.numel())
    engine = Versioned(module, **kw)
    engine.accum = 1
    return engine


def time_rank(rank, world, spec: ModelSpec, names: list[str], accum: int, warmup: int, reps: int) -> dict:
    """Alternate ``names`` window by window; wall time (max over ranks) and CPU time (sum) per window."""
    base = spec.build(seed=0)
    engines = {n: make_engine(n, copy.deepcopy(base)) for n in names}
    for engine in engines.values():
        engine.accum = accum  # the accumulator's window: the micro-steps alternate() runs per window
    res = alternate(engines, spec, rank, accum, warmup, reps)
    ref = [p.detach() for p in engines[names[1]].model.parameters()]  # every version trained on the same data
    diff = {n: reduce_max([max((a - b).abs().max().item() for a, b in zip(engines[n].model.parameters(), ref))])[0]
            for n in names[2:]}
    return {**res, "max_param_diff": diff}


def summarize(res: dict, names: list[str]) -> dict:
    torch_t, (before, again, after) = res["times"]["torch"], names[1:]
    t_before, t_cpu = res["times"][before], res["cpu"][before]
    ab = [a / b for a, b in zip(res["times"][after], t_before)]
    aa = [a / b for a, b in zip(res["times"][again], t_before)]
    rng = random.Random(0)  # bootstrap the median of the paired ratios: how far it could move by chance
    boots = sorted(statistics.median(rng.choices(ab, k=len(ab))) for _ in range(2000))
    med, (q1, q3) = statistics.median(ab), quartiles(aa)
    return {"median_ms": {n: 1e3 * statistics.median(t) for n, t in res["times"].items()},
            "to_torch": {n: statistics.median(a / b for a, b in zip(t, torch_t)) for n, t in res["times"].items()},
            "ab": med, "ab_iqr": quartiles(ab), "ab_range": [min(ab), max(ab)], "ab_ci95": [boots[50], boots[1949]],
            "aa": statistics.median(aa), "aa_iqr": [q1, q3], "aa_range": [min(aa), max(aa)],
            "cpu_ab": statistics.median(a / b for a, b in zip(res["cpu"][after], t_cpu)),
            "cpu_aa": statistics.median(a / b for a, b in zip(res["cpu"][again], t_cpu)),
            "outside": 0.0 if q1 <= med <= q3 else (med - q3 if med > q3 else med - q1),
            "max_param_diff": res["max_param_diff"], "raw": res["times"], "raw_cpu": res["cpu"]}


def wait_for_load(limit: float | None, most_s: float, poll_s: float = 10) -> float:
    """Sleep (``poll_s`` at a time, at most ``most_s``) until the 1-minute load average is at most
    ``limit``; return the seconds waited. Between rows only the decay of this benchmark's own ranks
    (about 2) is waited for, some 20 s; other jobs on the machine, up to ``most_s``."""
    waited = 0.0
    while limit is not None and os.getloadavg()[0] > limit and waited < most_s:
        if waited % 60 == 0:
            print(f"load {os.getloadavg()[0]:.2f} > {limit}: waiting", flush=True)
        time.sleep(poll_s)
        waited += poll_s
    return waited


class LoadSampler:
    """The largest 1-minute load average seen while the block runs (sampled every 2 s)."""

    def __enter__(self):
        self.start, self.peak, self._stop = os.getloadavg()[0], os.getloadavg()[0], threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(2.0):
            self.peak = max(self.peak, os.getloadavg()[0])

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.end = os.getloadavg()[0]
        self.peak = max(self.peak, self.end)


def fmt_row(r: dict) -> str:
    before, again, after = GROUPS[r["group"]][1:]
    verdict = "within" if r["outside"] == 0 else f"outside by {r['outside']:+.3f}"
    return (f"| {r['model']} | {r['accum']} | {r['group']} | {r['run']} | {r['median_ms']['torch']:.0f} | "
            f"{r['median_ms'][before]:.0f} | {r['median_ms'][after]:.0f} | **{r['ab']:.3f}** "
            f"[{r['ab_iqr'][0]:.3f}-{r['ab_iqr'][1]:.3f}] ({r['ab_range'][0]:.2f}-{r['ab_range'][1]:.2f}) | "
            f"{r['ab_ci95'][0]:.3f}-{r['ab_ci95'][1]:.3f} | {r['aa']:.3f} [{r['aa_iqr'][0]:.3f}-{r['aa_iqr'][1]:.3f}] "
            f"| {verdict} | {r['cpu_ab']:.3f} / {r['cpu_aa']:.3f} | {r['to_torch'][before]:.3f} / "
            f"{r['to_torch'][after]:.3f} | {r['max_param_diff'][after]:.1g} | {r['load'][0]:.1f} / "
            f"{r['load'][1]:.1f} |")


def summary(rows: list[dict]) -> list[str]:
    """Per group: the range of after/before medians and of A/A medians, and the rows outside the band."""
    lines = []
    for group in GROUPS:
        g = [r for r in rows if r["group"] == group]
        if g:
            named = [(r["outside"], f"{r['model']} acc {r['accum']} run {r['run']} ({r['outside']:+.3f})") for r in g]
            slower, faster = [n for d, n in named if d > 0], [n for d, n in named if d < 0]
            lines.append(f"- **{group}**: after/before {min(r['ab'] for r in g):.3f}-{max(r['ab'] for r in g):.3f}, "
                         f"A/A {min(r['aa'] for r in g):.3f}-{max(r['aa'] for r in g):.3f}; above the A/A band "
                         f"(slower): {', '.join(slower) or 'none'}; below it (faster): {', '.join(faster) or 'none'}.")
    return lines


def report(rec: dict) -> str:
    m, code, rows = rec["machine"], rec["code"], rec["rows"]
    state = "plus uncommitted changes" if code.get("dirty") else "no uncommitted changes"
    lines = [f"# Before/after: baseline {rec['base']} against the working tree ({', '.join(rec.get('groups', GROUPS))})", "",
             f"{rec['world']} gloo ranks on {m['cpu']} ({m['cores']} cores), torch {rec['torch']}, AdamW, "
             f"one intra-op thread per rank; {rec['reps']} timed rounds per row after {rec['warmup']} warm-up "
             f"(tiny-params: x{rec['tiny_reps_factor']}), {rec['runs']} run(s), {rec['seconds']:.0f} s in all. "
             f"Load average (1/5/15 min) {'/'.join(f'{x:.1f}' for x in rec['load_before'])} before, "
             f"{'/'.join(f'{x:.1f}' for x in rec['load_after'])} after (the benchmark's own 2 ranks included).", "",
             f"*before* = `gradsync` of commit {rec['base']}, imported as `gradsync_base`; *after* = the working "
             f"tree's `gradsync` (HEAD {code['head']}, {state}; package sha256 (tools aside) "
             f"{code['tree_sha256']}). They differ: only before {', '.join(code['only_before']) or '-'}; only after "
             f"{', '.join(code['only_after']) or '-'}; {len(code['changed'])} modules changed.", "",
             "Each row is one set of forked ranks with four engines on identical model copies, taking turns "
             "window by window in an order shuffled every round. *after/before* is the median of the per-round "
             "ratios [IQR] (min-max), then a bootstrap 95% interval of that median. *A/A* is a second baseline "
             "instance against the first, paired the same way: the noise. A row is *within* noise when the "
             "after/before median lies inside the A/A interquartile range; otherwise the distance to its nearer "
             "edge is given. CPU = process time summed over ranks, paired medians (after/before / A/A). "
             "Param diff = largest |after - before| parameter after the run (0: bit-identical training).", "",
             "## Result", ""] + summary(rows) + ["", "## Every row", "",
             "| model | accum | group | run | torch ms | before ms | after ms | after/before [IQR] (range) | 95% CI "
             "| A/A [IQR] | noise band | CPU a/b / A/A | before/torch / after/torch | param diff | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [fmt_row(r) for r in sorted(rows, key=lambda r: (r["group"], r["model"], r["accum"], r["run"]))]
    if rec["runs"] > 1:
        runs = " | ".join(f"run {i + 1}" for i in range(rec["runs"]))
        lines += ["", "## Do the runs agree?", "", "After/before paired medians per run; gap = largest - smallest.", "",
                  f"| model | accum | group | {runs} | gap |", "|---|---|---|" + "---|" * (rec["runs"] + 1)]
        by_key: dict[tuple, list[float]] = {}
        for r in sorted(rows, key=lambda r: r["run"]):
            by_key.setdefault((r["group"], r["model"], r["accum"]), []).append(r["ab"])
        for (g, model, accum), ab in by_key.items():
            cells = " | ".join(f"{x:.3f}" for x in ab)
            lines.append(f"| {model} | {accum} | {g} | {cells} | {max(ab) - min(ab):.3f} |")
    waited = sum(r["waited_s"] for r in rows)
    shared = [f"{r['model']} acc {r['accum']} {r['group']} run {r['run']} ({r['load'][1]:.1f})" for r in rows
              if r["load"][1] > SHARED_LOAD]
    lines += ["", f"Load: each row started once the 1-minute load average was at most {rec['wait_load']} "
              f"({waited:.0f} s of waiting in all); *load* = at the row's start / its peak, this benchmark's own "
              f"{rec['world']} ranks included. Rows whose peak passed {SHARED_LOAD} shared the cores with other "
              f"jobs: " + (", ".join(shared) or "none") + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default="7a4ad5f", help="the baseline commit (default: main before issue 24)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tiny-reps-factor", type=int, default=3, help="more rounds for the tiny-params model (cheap)")
    p.add_argument("--runs", type=int, default=None, help="whole timing runs, to see whether they agree "
                                                             "(default 2; --quick: 1)")
    p.add_argument("--accum", type=int, nargs="+", default=[1, 4])
    p.add_argument("--models", nargs="+", default=None, help="only these model names (e.g. gpt-12M)")
    p.add_argument("--groups", nargs="+", default=list(GROUPS), choices=list(GROUPS))
    p.add_argument("--wait-load", type=float, default=None,
                   help="before each row, wait until the 1-minute load average is at most this")
    p.add_argument("--wait-most", type=float, default=600, help="seconds to wait for the load at most, per row")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--name", help="file name stem (default: speed-before-after-<N>cpu-<date>)")
    p.add_argument("--quick", action="store_true", help="tiny models, 1 round: a smoke test, not a measurement")
    args = p.parse_args(argv)
    if args.quick:
        args.reps, args.warmup, args.tiny_reps_factor = 1, 1, 1
        import_before_forking()  # --quick only: measured runs leave the ranks as they were
    args.runs = args.runs or (1 if args.quick else 2)
    PACKAGES["before"], root = export_base(args.base)
    try:
        code = code_state(Path(PACKAGES["before"].__file__).parent)
        if not (code["only_before"] or code["only_after"] or code["changed"]):
            print(f"warning: the working tree's core and layers equal {args.base}'s: this is an A/A run", flush=True)
        start, load_before, rows = time.perf_counter(), os.getloadavg(), []
        for run in range(1, args.runs + 1):
            for spec in [m for m in bench_models(args.quick) if not args.models or m.name in args.models]:
                reps = args.reps * (args.tiny_reps_factor if spec.name.startswith("tiny") else 1)
                for accum in args.accum:
                    for group in args.groups:
                        waited = wait_for_load(args.wait_load, args.wait_most)
                        with LoadSampler() as load:
                            res = run_ranks(time_rank, args.world, spec, GROUPS[group], accum, args.warmup, reps,
                                            timeout=1800)[0]
                        rows.append({"model": spec.name, "accum": accum, "group": group, "run": run, "reps": reps,
                                     "waited_s": waited, "load": [load.start, load.peak, load.end],
                                     **summarize(res, GROUPS[group])})
                        r = rows[-1]
                        print(f"run {run} {spec.name} accum {accum} {group}: after/before {r['ab']:.3f} "
                              f"[{r['ab_iqr'][0]:.3f}-{r['ab_iqr'][1]:.3f}], A/A {r['aa']:.3f} "
                              f"[{r['aa_iqr'][0]:.3f}-{r['aa_iqr'][1]:.3f}], load {load.start:.1f} "
                              f"(peak {load.peak:.1f}), waited {waited:.0f} s", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rec = {"scenario": "speed-before-after", "quick": args.quick, "machine": machine_info(), "torch": torch.__version__, "world": args.world, "base": args.base,
           "code": code, "reps": args.reps, "warmup": args.warmup, "tiny_reps_factor": args.tiny_reps_factor,
           "runs": args.runs, "load_before": load_before, "load_after": os.getloadavg(), "wait_load": args.wait_load,
           "seconds": time.perf_counter() - start, "groups": list(args.groups), "rows": rows}
    write_record(args.out, args.name or record_stem("speed-before-after", args.quick), rec, report(rec))
    return rec


if __name__ == "__main__":
    main()
