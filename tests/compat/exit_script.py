"""Train a few steps on 2 gloo ranks and exit at once: a process that aborts at exit fails the run.

    torchrun --nproc_per_node 2 --standalone exit_script.py [gradsync|torch] [plain|bn|no_sync|accumulate|hook] \
        [destroy] [hold_gil]

Issue 14 item 2: after training, a rank died with "terminate called without an active
exception" while the interpreter shut down. ``destroy`` ends with ``destroy_process_group()``.
``hold_gil`` lets the main thread keep the GIL until it blocks (a 1 s switch interval) and puts
gloo's threads on its core, so that they rarely run between a wait and the exit: a gloo thread
that needs the GIL to drop something then gets it before shutdown only if gradsync gives it
the chance. That turns an occasional abort into a frequent one. Nothing is printed: writing
releases the GIL.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import gradsync


def main() -> None:
    if "EXIT_SCRIPT_LOG" in os.environ:  # forked by exit_launches.py: this rank's own output file
        log = os.open(os.environ["EXIT_SCRIPT_LOG"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 1)
        os.dup2(log, 2)
    impl, variant = (sys.argv[1:3] + ["gradsync", "plain"][len(sys.argv[1:3]):])[:2]
    if "hold_gil" in sys.argv[3:]:
        sys.setswitchinterval(1.0)
        cpus = sorted(os.sched_getaffinity(0))  # gloo's threads, started next, share the main thread's core
        os.sched_setaffinity(0, [cpus[int(os.environ["LOCAL_RANK"]) % len(cpus)]])
    dist.init_process_group("gloo")
    torch.manual_seed(dist.get_rank())
    torch.set_num_threads(1)
    layers = [nn.Linear(16, 32), nn.ReLU()]
    if variant == "bn":
        layers.insert(1, nn.BatchNorm1d(32))
    module = nn.Sequential(*layers, nn.Linear(32, 4))
    ddp_class = gradsync.DistributedDataParallel if impl == "gradsync" else nn.parallel.DistributedDataParallel
    model = ddp_class(module, bucket_cap_mb=0.001)  # several buckets
    if variant == "hook":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = None
    if variant == "accumulate":
        acc = gradsync.GradientAccumulator(model, steps=2)
        optimizer = acc.wrap_optimizer(optimizer)
    for step in range(4):
        x, y = torch.randn(8, 16), torch.randn(8, 4)
        if acc is not None:
            with acc.accumulate():
                acc.backward(nn.functional.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
        elif variant == "no_sync" and step % 2 == 0:
            with model.no_sync():
                nn.functional.mse_loss(model(x), y).backward()
        else:
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    if "destroy" in sys.argv[3:]:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
