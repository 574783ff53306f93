"""A tiny GPT-2 trained by the Hugging Face ``Trainer`` on 2 CPU ranks, on torch's DDP or on gradsync.

    torchrun --standalone --nproc_per_node 2 hf_trainer.py RESULT_DIR MODE:CONFIG...

MODE is ``torch`` or ``gradsync``; CONFIG is ``plain`` (the Trainer's defaults for DDP) or
``static`` (``ddp_static_graph=True``). The runs go in turn, in the same processes, each with a
fresh model and Trainer: the swap is scoped, so a torch run after a gradsync one gets torch's DDP
again. A run that fails ends the launch. Every run: GPT-2 with 2 layers and no dropout, random
tokens built in-process (no downloads), rows padded to different lengths with ``-100`` labels so
the micro-batches hold different numbers of tokens, per-device batch 2,
``gradient_accumulation_steps=4``, 3 optimizer steps, the Trainer's default
``average_tokens_across_devices=True``.

With ``gradsync`` the documented recipe runs: ``with gradsync.replace_torch_ddp(): trainer.train()``.
Each rank writes ``RESULT_DIR/<mode>-<config>-rank<r>.pt`` after each run: the trained weights, the
class the Trainer wrapped the model in, the ``num_items_in_batch`` of every micro-step, the first window's
micro-batches, the initial weights and the first window's gradient (read just before the
optimizer's first step, after the Trainer's clipping), or the error that ended the run.
"""
from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import torch

VOCAB, SEQ, ROWS = 64, 16, 48  # 48 rows = 3 steps of 2 ranks x 4 micro-batches x 2 rows
MAX_GRAD_NORM = 1.0  # the Trainer's default, stated: the test checks its gradient stays below it


def build_model():
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def build_rows():
    """Random token rows; row i has 4 + (i * 5) % 12 real tokens, the rest padding with label -100."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(ROWS):
        ids = torch.randint(1, VOCAB, (SEQ,), generator=g)
        n = 4 + (i * 5) % (SEQ - 4)
        mask = (torch.arange(SEQ) < n).long()
        rows.append({"input_ids": ids * mask, "attention_mask": mask, "labels": torch.where(mask.bool(), ids, -100)})
    return rows


def train(mode: str, config: str, out: Path, rank: int) -> dict:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import gradsync

    record: dict = {"mode": mode, "config": config, "rank": rank, "num_items": [], "window0": []}
    model = build_model()
    record["initial"] = {k: v.detach().clone() for k, v in model.state_dict().items()}

    class Recording(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            record["num_items"].append(None if num_items_in_batch is None else float(num_items_in_batch))
            if self.state.global_step == 0:
                record["window0"].append({k: v.detach().clone() for k, v in inputs.items()})
            record["accepts_loss_kwargs"] = self.model_accepts_loss_kwargs
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    class FirstGradient(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if state.global_step == 0:
                record["grad0"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                   if p.grad is not None}

    args = TrainingArguments(
        output_dir=str(out / f"trainer-{config}-{mode}"), per_device_train_batch_size=2,
        gradient_accumulation_steps=4, max_steps=3, learning_rate=1e-2, max_grad_norm=MAX_GRAD_NORM,
        use_cpu=True, ddp_backend="gloo", ddp_timeout=60, report_to=[], save_strategy="no",
        logging_strategy="no", seed=0, disable_tqdm=True, dataloader_num_workers=0,
        ddp_static_graph=(config == "static") or None)
    record["average_tokens_across_devices"] = args.average_tokens_across_devices
    trainer = Recording(model=model, args=args, train_dataset=build_rows(), callbacks=[FirstGradient()])
    try:
        if mode == "gradsync":
            with gradsync.replace_torch_ddp():  # the recipe: DDP is built inside train()
                trainer.train()
        else:
            trainer.train()
        record["finished"] = True
    except Exception as exc:  # torch's DDP with static_graph=True and accumulation: pytorch#143580
        record["error"] = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"[:500]
        record["traceback"] = traceback.format_exc()[-3000:]
    wrapped = trainer.model_wrapped
    record["wrapped_in"] = f"{type(wrapped).__module__}.{type(wrapped).__qualname__}"
    record["isinstance_torch_ddp"] = isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)
    record["global_step"] = trainer.state.global_step
    record["weights"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    record["replaced_after"] = gradsync.ddp.compat.is_torch_ddp_replaced()
    torch.save(record, out / f"{mode}-{config}-rank{rank}.pt")
    return record


def main() -> None:
    out, runs = Path(sys.argv[1]), [tuple(a.split(":")) for a in sys.argv[2:]]
    if not runs or any(r not in {(m, c) for m in ("torch", "gradsync") for c in ("plain", "static")} for r in runs):
        raise SystemExit(f"usage: {sys.argv[0]} RESULT_DIR {{torch,gradsync}}:{{plain,static}}...")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    for mode, config in runs:
        record = train(mode, config, out, rank)
        if "error" in record:
            break  # a crashed run may leave the ranks out of step: stop here
    (out / f"done-rank{rank}").touch()
    # a crash inside a DDP backward can leave gloo's threads in any state: leave without teardown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
