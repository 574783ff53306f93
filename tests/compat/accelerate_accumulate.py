"""The Accelerate recipe on 2 CPU ranks: a training loop with ``accelerator.accumulate(model)``.

    torchrun --standalone --nproc_per_node 2 accelerate_accumulate.py RESULT_DIR

Each loop runs first on torch's DDP, then on gradsync, in the same processes: with ``gradsync``
the documented recipe runs, ``with gradsync.replace_torch_ddp():`` around ``accelerator.prepare(...)``;
with ``torch`` the same code without it. The loops:

* ``mean``: ``Accelerator(gradient_accumulation_steps=4)``, ``accelerator.accumulate(model)``, a mean
  loss and ``accelerator.backward``, AdamW with a scheduler; 10 micro-batches per rank, so the
  windows are 4, 4 and the short 2 that Accelerate closes where the data ends.
* ``tokens``: Accelerate's own recipe for an exact mean over tokens of every micro-batch and rank
  (accelerate's ``gradient_accumulation_for_autoregressive_models.py``): count the window's tokens,
  ``accelerator.gather`` the count, loss = summed loss / count * steps * processes, then
  ``accelerator.backward``. Rows carry ``-100`` labels, so micro-batches hold different counts.
* ``num_items`` (gradsync only): the same data and windows through ``gradsync.GradientAccumulator``
  with ``acc.backward(loss_sum, num_items=n)`` instead of ``accelerator.accumulate``/``backward``,
  on the model and optimizer Accelerate prepared (an ``Accelerator`` without accumulation).

Each rank writes ``RESULT_DIR/<mode>-<loop>-rank<r>.pt``: the final weights, the wrapped class,
the optimizer steps taken and the micro-steps that synchronized.
"""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 5))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 8, generator=g)
    y = torch.randint(0, 5, (96,), generator=g)
    y[torch.rand(96, generator=g) < 0.4] = -100  # ignored rows: each micro-batch counts differently
    y[::4] = torch.randint(0, 5, (24,), generator=g)  # at least one counted row in every micro-batch of 4
    return model, torch.utils.data.TensorDataset(x, y)


def record_of(accelerator, model, opt_steps, synced, loop):
    return {"loop": loop, "wrapped_in": f"{type(model).__module__}.{type(model).__qualname__}",
            "isinstance_torch_ddp": isinstance(model, torch.nn.parallel.DistributedDataParallel),
            "optimizer_steps": opt_steps, "synced": synced, "num_processes": accelerator.num_processes,
            "weights": {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}}


def prepared(mode, accelerator, rows):
    import gradsync

    model, data = build()
    data = torch.utils.data.Subset(data, range(rows))
    loader = torch.utils.data.DataLoader(data, batch_size=4)  # in order: row 4i of each batch counts
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    replace = gradsync.replace_torch_ddp() if mode == "gradsync" else contextlib.nullcontext()
    with replace:  # the recipe: only the construction needs the swap
        model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    return model, opt, loader, sched


def count_steps(opt):
    steps = [0]
    inner = opt.optimizer if hasattr(opt, "optimizer") else opt
    inner.register_step_post_hook(lambda *_: steps.__setitem__(0, steps[0] + 1))
    return steps


def loop_mean(mode):
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    model, opt, loader, sched = prepared(mode, accelerator, rows=80)  # 10 micro-batches of 4 per rank
    steps, synced = count_steps(opt), []
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(x), y, ignore_index=-100)
            accelerator.backward(loss)
            synced.append(accelerator.sync_gradients)
            opt.step()
            sched.step()
            opt.zero_grad()
    return record_of(accelerator, model, steps[0], synced, "mean")


def loop_tokens(mode):
    from accelerate import Accelerator
    from accelerate.utils import GradientAccumulationPlugin
    # the window's batches are fetched before it runs, so Accelerate must not sync where the
    # loader ends (it would, one window early): 12 micro-batches per rank, 3 full windows
    plugin = GradientAccumulationPlugin(num_steps=4, sync_with_dataloader=False)
    accelerator = Accelerator(cpu=True, gradient_accumulation_plugin=plugin)
    model, opt, loader, sched = prepared(mode, accelerator, rows=96)
    steps, synced = count_steps(opt), []
    it = iter(loader)
    for _ in range(3):
        batches = [next(it) for _ in range(4)]
        n = accelerator.gather(sum((y != -100).sum() for _, y in batches).reshape(1)).sum()
        for x, y in batches:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y, ignore_index=-100, reduction="sum") / n
                loss = loss * accelerator.gradient_accumulation_steps * accelerator.num_processes
                accelerator.backward(loss)
                synced.append(accelerator.sync_gradients)
                opt.step()
                sched.step()
                opt.zero_grad()
    return record_of(accelerator, model, steps[0], synced, "tokens")


def loop_num_items(mode):
    from accelerate import Accelerator

    import gradsync
    accelerator = Accelerator(cpu=True)  # no accumulation in Accelerate: gradsync's accumulator owns it
    model, opt, loader, sched = prepared(mode, accelerator, rows=96)
    steps, synced = count_steps(opt), []
    acc = gradsync.GradientAccumulator(model, steps=4)
    opt, sched = acc.wrap_optimizer(opt), acc.wrap_scheduler(sched)
    for x, y in acc.iterate(loader):
        with acc.accumulate():
            loss_sum = F.cross_entropy(model(x), y, ignore_index=-100, reduction="sum")
            acc.backward(loss_sum, num_items=(y != -100).sum())
            synced.append(acc.sync_gradients)
            opt.step()
            sched.step()
            opt.zero_grad()
    return record_of(accelerator, model, steps[0], synced, "num_items")


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: {sys.argv[0]} RESULT_DIR")
    import gradsync

    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    runs = [("torch", loop_mean), ("torch", loop_tokens),
            ("gradsync", loop_mean), ("gradsync", loop_tokens), ("gradsync", loop_num_items)]
    for mode, loop in runs:
        record = loop(mode)
        record["replaced_after"] = gradsync.ddp.compat.is_torch_ddp_replaced()
        torch.save(record, out / f"{mode}-{record['loop']}-rank{rank}.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
