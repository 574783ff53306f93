"""Run Accelerate's own ``test_utils/scripts/test_sync.py`` on 2 CPU ranks, with torch's DDP or gradsync.

    python accelerate_sync.py {torch,gradsync}[,...] RESULT_DIR

Several modes run one after another from the same launcher process (each launch forks its own two
ranks), each writing into ``RESULT_DIR/MODE/``.

Launched the way Accelerate's own CPU tests launch it (``accelerate.debug_launcher``: 2 forked
gloo ranks, file rendezvous, ``ACCELERATE_USE_CPU``). With ``gradsync`` the launcher process enters
``gradsync.replace_torch_ddp()`` first; the forked ranks inherit it, and Accelerate's
``prepare()`` then builds gradsync wrappers through ``torch.nn.parallel.DistributedDataParallel``.

The script's ``main()`` stops at the first failure and, on MULTI_CPU, skips the cases it keeps for
GPU types (they run fine on CPU). So each rank runs every call ``main()`` can make, in ``main()``'s
order, one at a time, recording pass/fail; ``cpu_main`` marks the ones ``main()`` itself runs on
MULTI_CPU. After each case the ranks meet at the store (not a collective), so a case that leaves
the ranks out of step ends the run instead of hanging it. Each rank writes
``rank<r>.json`` after every case.

The script builds ``RegressionDataset(length=...)`` without a seed, so each process draws its data from
the OS's entropy and every case asserting "not in sync" holds only by luck: at the script's own
tolerance a rank's half-batch gradient matches the global one about once in 4,000 such cases (a
simulation of its arithmetic), and one CI run failed that way. Here every rank builds it with one
fixed seed (``DATASET_SEED``), as a real dataset is the same file on every rank: each run is the same.
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

DATASET_SEED = 0


def cases(ts, accelerator):
    """(name, runs in main() on MULTI_CPU, call) for every call test_sync.main() can make, in its order."""
    out = [("test_dataloader_break", True, ts.test_dataloader_break),
           ("test_distributed_sync", True, lambda: ts.test_distributed_sync(accelerator)),
           ("test_distributed_sync_multiple_fwd", True, lambda: ts.test_distributed_sync_multiple_fwd(accelerator))]
    combos = [(s, d, e) for s in (True, False) for d in (True, False) for e in (True, False)]
    for s, d, e in combos:
        out.append((f"test_gradient_accumulation(split_batches={s}, dispatch_batches={d}, sync_each_batch={e})",
                    False, lambda s=s, d=d, e=e: ts.test_gradient_accumulation(s, d, e)))
    out.append(("test_gradient_accumulation_with_opt_and_scheduler(split_batches=False, dispatch_batches=False, "
                "sync_each_batch=False)", True, ts.test_gradient_accumulation_with_opt_and_scheduler))
    for s, d, e in combos:
        if not s and not d and not e:
            continue
        out.append((f"test_gradient_accumulation_with_opt_and_scheduler(split_batches={s}, dispatch_batches={d}, "
                    f"sync_each_batch={e})", False,
                    lambda s=s, d=d, e=e: ts.test_gradient_accumulation_with_opt_and_scheduler(s, d, e)))
    return out


def run_rank(mode: str, result_dir: str) -> None:
    from accelerate import Accelerator
    from accelerate.state import GradientState
    from accelerate.test_utils.scripts import test_sync as ts
    from accelerate.utils import DistributedType

    import gradsync

    unseeded = ts.RegressionDataset
    ts.RegressionDataset = lambda *args, **kwargs: unseeded(*args, **{"seed": DATASET_SEED, **kwargs})
    torch.set_num_threads(1)
    accelerator = Accelerator()
    rank = accelerator.process_index
    record = {"mode": mode, "rank": rank, "distributed_type": str(accelerator.distributed_type),
              "accelerate_file": ts.__file__, "cases": [],
              "dataset_x0": float(ts.RegressionDataset(length=1).x[0])}
    out = Path(result_dir) / f"rank{rank}.json"

    # which class Accelerate's prepare() builds (a collective: every rank does it)
    probe = accelerator.prepare(torch.nn.Linear(2, 2))
    record["ddp_class"] = f"{type(probe).__module__}.{type(probe).__qualname__}"
    record["isinstance_torch_ddp"] = isinstance(probe, torch.nn.parallel.DistributedDataParallel)
    record["isinstance_gradsync"] = isinstance(probe, gradsync.DistributedDataParallel)
    del probe
    assert accelerator.distributed_type == DistributedType.MULTI_CPU, accelerator.distributed_type

    store = dist.distributed_c10d._get_default_store()
    world = accelerator.num_processes
    for i, (name, cpu_main, call) in enumerate(cases(ts, accelerator)):
        entry = {"name": name, "cpu_main": cpu_main}
        try:
            call()
            entry["result"] = "pass"
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [""])[0]
            entry["result"] = "fail"
            entry["error"] = f"{type(exc).__name__}: {first}"[:300]
            entry["traceback"] = traceback.format_exc()[-3000:]
            GradientState._reset_state()  # what the failed case would have done on success
        record["cases"].append(entry)
        out.write_text(json.dumps(record, indent=1))
        store.set(f"case{i}/rank{rank}", entry["result"])
        try:  # meet the other ranks outside the collectives; a rank stuck in one never arrives
            store.wait([f"case{i}/rank{r}" for r in range(world)], timedelta(seconds=60))
        except Exception:
            record["diverged_after"] = name
            out.write_text(json.dumps(record, indent=1))
            sys.stdout.flush()
            os._exit(3)
    record["finished"] = True
    out.write_text(json.dumps(record, indent=1))


def main() -> None:
    modes, result_dir = sys.argv[1].split(","), Path(sys.argv[2])
    if not set(modes) <= {"torch", "gradsync"}:
        raise SystemExit(f"usage: {sys.argv[0]} {{torch,gradsync}}[,...] RESULT_DIR")
    from accelerate import debug_launcher

    import gradsync

    torch.set_num_threads(1)
    for mode in modes:
        (result_dir / mode).mkdir(parents=True, exist_ok=True)
        handle = gradsync.replace_torch_ddp() if mode == "gradsync" else None
        try:
            debug_launcher(run_rank, args=(mode, str(result_dir / mode)), num_processes=2)
        finally:
            if handle is not None:
                handle.undo()


if __name__ == "__main__":
    main()
