"""A Fabric training loop on 2 CPU ranks with gradient accumulation through ``fabric.no_backward_sync``.

    python fabric_loop.py MODE[,MODE...] OUT_DIR      (modes: ddp, gradsync, gradsync_sharded, amp_*, value_*)

The modes run one after another in the same two processes, each writing into ``OUT_DIR/MODE/``.

Fabric's strategy by name: ``ddp`` is torch's DDP, ``gradsync`` needs ``import gradsync.lightning``; ``amp_ddp`` and
``amp_sharded`` are ``ddp`` and ``gradsync_sharded`` with fp16 autocast and loss scaling (``MixedPrecision`` plugin);
``value_ddp`` and ``value_sharded`` clip by value (``clip_val=CLIP_VALUE``) instead of by norm.
Rank 1 is started by Fabric re-running this script. 2 epochs of 10 micro-batches per rank, windows
of 4, 4 and 2, clipped by norm; a comm hook counts the all-reduced buckets (not for the sharded wrapper). Each rank
writes ``rank<r>.pt`` (weights, optimizer steps, wrapper class, syncs) and, after a
``fabric.save``/``fabric.load`` round trip, ``rank<r>.done``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.utils.data import DataLoader

from lightning_fit import ACCUMULATE, BATCH, EPOCHS, dataset

MODES = ("ddp", "gradsync", "gradsync_sharded", "amp_ddp", "amp_sharded", "value_ddp", "value_sharded")
CLIP = 0.05  # clips most windows' gradients (global norm ~0.3): the sharded global norm is compared too
CLIP_VALUE = 0.01  # clip_val: clamps some elements of most windows' gradients


def main() -> None:
    modes, out_dir = sys.argv[1].split(","), Path(sys.argv[2])
    if not set(modes) <= set(MODES):
        raise SystemExit(f"usage: {sys.argv[0]} MODE[,MODE...] OUT_DIR with modes from {{{','.join(MODES)}}}")
    torch.set_num_threads(1)
    for mode in modes:
        (out_dir / mode).mkdir(parents=True, exist_ok=True)
        loop(mode, out_dir / mode)


def loop(mode: str, out_dir: Path) -> None:
    import lightning as L

    import gradsync.lightning  # noqa: F401  registers Fabric(strategy="gradsync")

    strategy, plugins = mode, []
    if mode.startswith("amp_"):  # as a plugin: Fabric(accelerator="cpu", precision="16-mixed") is refused
        from lightning.fabric.plugins import MixedPrecision
        strategy, plugins = "ddp" if mode == "amp_ddp" else "gradsync_sharded", [MixedPrecision("16-mixed", "cpu")]
    if mode.startswith("value_"):
        strategy = "ddp" if mode == "value_ddp" else "gradsync_sharded"
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=plugins)
    fabric.launch()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
    wrapper = model._forward_module  # the DDP wrapper Fabric built
    syncs = [0]

    def counting(state, bucket):
        syncs[0] += 1
        return allreduce_hook(None, bucket)

    if strategy != "gradsync_sharded":
        wrapper.register_comm_hook(None, counting)
    loader = fabric.setup_dataloaders(DataLoader(dataset(), batch_size=BATCH, shuffle=False))
    steps = 0
    for _ in range(EPOCHS):
        for i, (x, y) in enumerate(loader):
            closes = (i + 1) % ACCUMULATE == 0 or i + 1 == len(loader)
            with fabric.no_backward_sync(model, enabled=not closes):
                fabric.backward(F.mse_loss(model(x), y) / ACCUMULATE)
            if closes:
                if mode.startswith("value_"):
                    fabric.clip_gradients(model, optimizer, clip_val=CLIP_VALUE)
                else:
                    fabric.clip_gradients(model, optimizer, max_norm=CLIP)
                optimizer.step()
                optimizer.zero_grad()
                steps += 1
    weights = {k: v.detach().clone() for k, v in net.state_dict().items()}
    torch.save({"weights": weights, "optimizer_steps": steps, "syncs": syncs[0],
                "wrapped_in": (f"{type(wrapper).__module__}.{type(wrapper).__qualname__}",
                               isinstance(wrapper, torch.nn.parallel.DistributedDataParallel))},
               out_dir / f"rank{fabric.global_rank}.pt")
    # checkpoint round trip: the saved state is the inner module's, and loads back unchanged
    state = {"model": model, "optimizer": optimizer}
    fabric.save(out_dir / "fabric.ckpt", state)
    with torch.no_grad():
        for p in net.parameters():
            p.zero_()
    fabric.load(out_dir / "fabric.ckpt", state)
    restored = all(torch.equal(v, net.state_dict()[k]) for k, v in weights.items())
    scaler = type(getattr(fabric.strategy.precision, "scaler", None)).__name__
    (out_dir / f"rank{fabric.global_rank}.done").write_text(f"restored: {restored}\n" + (f"scaler: {scaler}\n" if plugins else ""))


if __name__ == "__main__":
    main()
