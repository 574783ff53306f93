"""A Lightning ``Trainer(strategy="ddp")`` fit on 2 CPU ranks, with torch's DDP or with gradsync.

    python lightning_fit.py {torch,gradsync}[,...] OUT_DIR

Several modes run one after another in the same two processes, each writing into ``OUT_DIR/MODE/``.

Lightning's DDP strategy on CPU starts rank 1 by re-running this script (same argv, LOCAL_RANK set),
so every rank enters ``gradsync.replace_torch_ddp()`` itself before building the Trainer. Each
rank writes ``rank<r>.pt`` at the end of training (before the strategy's teardown): the
final weights, the class Lightning wrapped the model in and how many optimizer steps ran; and
``rank<r>.done`` once ``trainer.fit`` has returned. Deterministic data, no logger, no checkpoints, no downloads.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

SAMPLES = 160          # 80 per rank: 10 micro-batches of 8, windows of 4, 4 and a short 2 per epoch
BATCH = 8
ACCUMULATE = 4
EPOCHS = 2


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, 16, generator=g)
    y = torch.randn(SAMPLES, 4, generator=g)
    return TensorDataset(x, y)


def make_module(mode: str, out_dir: Path):
    import lightning as L

    class Regressor(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
            self.wrapped_in = None
            self.optimizer_steps = 0

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self(x), y)

        def on_train_start(self):
            model = self.trainer.strategy.model
            self.wrapped_in = (f"{type(model).__module__}.{type(model).__qualname__}",
                               isinstance(model, torch.nn.parallel.DistributedDataParallel))

        def on_before_optimizer_step(self, optimizer):
            self.optimizer_steps += 1

        def on_train_end(self):
            # Written here, after the last optimizer step and before the strategy's teardown, so
            # the weights are on disk even if teardown fails.
            weights = {k: v.detach().clone() for k, v in self.state_dict().items()}
            torch.save({"mode": self.mode, "weights": weights, "wrapped_in": self.wrapped_in,
                        "optimizer_steps": self.optimizer_steps, "global_step": self.trainer.global_step},
                       self.out_dir / f"rank{self.trainer.global_rank}.pt")

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    module = Regressor()
    module.mode, module.out_dir = mode, out_dir
    return module


def main() -> None:
    modes, out_dir = sys.argv[1].split(","), Path(sys.argv[2])
    if not set(modes) <= {"torch", "gradsync"}:
        raise SystemExit(f"usage: {sys.argv[0]} {{torch,gradsync}}[,...] OUT_DIR")
    torch.set_num_threads(1)
    for mode in modes:
        (out_dir / mode).mkdir(parents=True, exist_ok=True)
        fit(mode, out_dir / mode)


def fit(mode: str, out_dir: Path) -> None:
    import lightning as L

    import gradsync

    handle = gradsync.replace_torch_ddp() if mode == "gradsync" else None
    try:
        module = make_module(mode, out_dir)
        trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, accumulate_grad_batches=ACCUMULATE,
                            max_epochs=EPOCHS, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
        trainer.fit(module, DataLoader(dataset(), batch_size=BATCH, shuffle=False))
        (out_dir / f"rank{trainer.global_rank}.done").write_text("fit returned\n")
    finally:
        if handle is not None:
            handle.undo()


if __name__ == "__main__":
    main()
