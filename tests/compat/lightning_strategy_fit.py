"""Lightning fits on 2 CPU ranks with a strategy chosen by name, without replace_torch_ddp().

    python lightning_strategy_fit.py MODE[,MODE...] OUT_DIR

The modes run one after another in the same two processes (rank 1, started by the first fit, runs
the same list; later fits find the process group formed): each writes into ``OUT_DIR/MODE/``, and
``part1*``/``resume*`` share the checkpoint folder ``OUT_DIR/ckpt`` (``OUT_DIR/ckpt_sharded``).

MODE: ``ddp`` (torch's DDP), ``gradsync`` (``strategy="gradsync"``), ``gradsync_sharded``,
``part1`` (``GradsyncStrategy(...)`` with options, 1 epoch, checkpoint into the checkpoint folder), ``resume``
(the same strategy, 2 epochs from its part1.ckpt), ``part1_sharded`` and ``resume_sharded``
(the same with ``strategy="gradsync_sharded"``), ``manual_ddp`` and ``manual_gradsync`` (manual
optimization, accumulating with ``toggle_model``), ``amp_ddp`` and ``amp_sharded`` (fp16 autocast with loss
scaling: Lightning's ``MixedPrecision("16-mixed", "cpu")`` plugin, on ``"ddp"`` and ``"gradsync_sharded"``),
``value_ddp`` and ``value_sharded`` (``gradient_clip_algorithm="value"`` at ``CLIP_VALUE``). Same model, data and accumulation as
``lightning_fit.py``, whose module writes ``OUT_DIR/MODE/rank<r>.pt``; gradients are clipped by norm
(``gradient_clip_val``); a callback
counts the gradient all-reduces (a comm hook; ``ddp_comm_hook=`` in ``part1``/``resume``) into
``OUT_DIR/MODE/syncs<r>.txt``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.utils.data import DataLoader

from lightning_fit import ACCUMULATE, BATCH, EPOCHS, dataset, make_module

CLIP = 0.05  # gradient_clip_val: clips most windows' gradients, so the clipping paths are compared too
CLIP_VALUE = 0.01  # gradient_clip_algorithm="value": clamps some elements of most windows' gradients
MODES = ("ddp", "gradsync", "gradsync_sharded", "part1", "resume", "part1_sharded", "resume_sharded",
         "manual_ddp", "manual_gradsync", "amp_ddp", "amp_sharded", "value_ddp", "value_sharded")


def counting_callback(out_dir: Path, register: bool = True):
    import lightning as L

    class CountSyncs(L.Callback):
        """Counts the buckets each rank all-reduces: accumulation must block all but one per window."""

        def __init__(self):
            self.count = 0

        def hook(self, state, bucket):
            self.count += 1
            return allreduce_hook(None, bucket)

        def on_train_start(self, trainer, pl_module):
            if register:  # else the strategy registered it (ddp_comm_hook=)
                trainer.strategy.model.register_comm_hook(None, self.hook)

        def on_train_end(self, trainer, pl_module):
            (out_dir / f"syncs{trainer.global_rank}.txt").write_text(f"{self.count}\n")

    return CountSyncs()


def manual_module(mode: str, out_dir: Path):
    """The same regressor under manual optimization: ``toggle_model(sync_grad=...)`` accumulates."""
    import torch.nn.functional as F

    base = type(make_module(mode, out_dir))

    class Manual(base):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            closes = (batch_idx + 1) % ACCUMULATE == 0 or batch_idx + 1 == self.trainer.num_training_batches
            with opt.toggle_model(sync_grad=closes):
                x, y = batch
                self.manual_backward(F.mse_loss(self(x), y) / ACCUMULATE)
            if closes:
                self.clip_gradients(opt, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
                opt.step()
                opt.zero_grad()

    module = Manual()
    module.mode, module.out_dir = mode, out_dir
    return module


def main() -> None:
    modes, out_dir = sys.argv[1].split(","), Path(sys.argv[2])
    if not set(modes) <= set(MODES):
        raise SystemExit(f"usage: {sys.argv[0]} MODE[,MODE...] OUT_DIR with modes from {{{','.join(MODES)}}}")
    torch.set_num_threads(1)
    for mode in modes:
        (out_dir / mode).mkdir(parents=True, exist_ok=True)
        fit(mode, out_dir / mode, out_dir / ("ckpt_sharded" if mode.endswith("_sharded") else "ckpt"))


def fit(mode: str, out_dir: Path, ckpt_dir: Path) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    import gradsync.lightning

    sharded = mode.endswith("_sharded")
    with_options = mode in ("part1", "resume")
    callbacks = [] if sharded else [counting_callback(out_dir, register=not with_options)]
    strategy, epochs, ckpt_path = mode, EPOCHS, None
    if mode.startswith(("part1", "resume")):
        # gradsync's options as strategy arguments (fp32 reduction of fp32 parameters changes no
        # bit) and the counting hook as Lightning's ddp_comm_hook; the sharded pair by name
        strategy = "gradsync_sharded" if sharded else gradsync.lightning.GradsyncStrategy(
            reduce_dtype=torch.float32, sync_timeout=120, bucket_cap_mb=25, ddp_comm_hook=callbacks[0].hook)
        if mode.startswith("part1"):
            epochs = 1
            callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, filename="part1", save_top_k=1))
        else:
            ckpt_path = ckpt_dir / "part1.ckpt"
    plugins = []
    if mode.startswith("amp_"):  # as a plugin: Trainer(accelerator="cpu", precision="16-mixed") is refused
        from lightning.pytorch.plugins import MixedPrecision
        plugins, strategy = [MixedPrecision("16-mixed", "cpu")], "ddp" if mode == "amp_ddp" else "gradsync_sharded"
    if mode.startswith("value_"):
        strategy = "ddp" if mode == "value_ddp" else "gradsync_sharded"
    module, accumulate = make_module(mode, out_dir), ACCUMULATE
    if mode.startswith("manual"):  # the module accumulates itself
        module, accumulate, strategy = manual_module(mode, out_dir), 1, mode[len("manual_"):]
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, accumulate_grad_batches=accumulate,
                        gradient_clip_val=None if mode.startswith("manual") else CLIP_VALUE if mode.startswith("value_") else CLIP,
                        gradient_clip_algorithm="value" if mode.startswith("value_") else "norm",
                        max_epochs=epochs, logger=False, enable_checkpointing=mode.startswith("part1"),
                        callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, plugins=plugins)
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH, shuffle=False), ckpt_path=ckpt_path)
    replaced = gradsync.ddp.compat.is_torch_ddp_replaced()
    scaler = type(getattr(trainer.precision_plugin, "scaler", None)).__name__
    (out_dir / f"rank{trainer.global_rank}.done").write_text(f"fit returned; torch ddp replaced: {replaced}; scaler: {scaler}\n")


if __name__ == "__main__":
    main()
