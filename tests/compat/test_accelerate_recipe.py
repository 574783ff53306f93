"""The Accelerate recipe (docs/integrations.md) on 2 torchrun CPU ranks: torch's DDP vs gradsync.

``with gradsync.replace_torch_ddp(): ... = accelerator.prepare(...)``, then an unchanged loop with
``accelerator.accumulate(model)`` and ``gradient_accumulation_steps=4``: the same micro-steps
synchronize, the optimizer steps as often, and the weights are torch's bit for bit, with a mean loss
(a short last window included) and with Accelerate's own exact token averaging. gradsync's
``num_items`` on the same prepared model reaches the same weights instead of Accelerate's recipe.
"""
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate", reason="accelerate is not installed: pip install torch==2.13.0 -e '.[compat]'")

from compat_proc import assert_identical, run_bounded  # noqa: E402

pytestmark = pytest.mark.compat
SCRIPT = Path(__file__).with_name("accelerate_accumulate.py")
TIMEOUT = 180  # the launch takes ~25 s on 2 idle cores
LOOPS = {"torch": ["mean", "tokens"], "gradsync": ["mean", "tokens", "num_items"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("accelerate-recipe")
    proc = run_bounded([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                        str(SCRIPT), str(out)], TIMEOUT, log=out / "log")
    assert not proc.timed_out and proc.returncode == 0, (
        f"exit {proc.returncode}, timed out {proc.timed_out}\n{proc.tail}")
    return {mode: {loop: [torch.load(out / f"{mode}-{loop}-rank{r}.pt", weights_only=False) for r in range(2)]
                   for loop in loops} for mode, loops in LOOPS.items()}


@pytest.fixture(scope="module")
def torch_run(runs):
    return runs["torch"]


@pytest.fixture(scope="module")
def gradsync_run(runs):
    return runs["gradsync"]


@pytest.mark.parametrize("loop", ["mean", "tokens"])
def test_accelerate_accumulate_on_gradsync_gives_torchs_weights(torch_run, gradsync_run, loop):
    expected = torch_run[loop][0]
    assert expected["wrapped_in"] == "torch.nn.parallel.distributed.DistributedDataParallel"
    # mean: 10 micro-batches per rank, windows 4, 4 and the 2 Accelerate closes at the data's end
    windows = {"mean": [4, 4, 2], "tokens": [4, 4, 4]}[loop]
    assert expected["synced"] == [i == w - 1 for w in windows for i in range(w)]
    assert expected["optimizer_steps"] == 3
    for rank, r in enumerate(gradsync_run[loop]):
        assert r["wrapped_in"] == "gradsync.ddp.compat.DistributedDataParallel" and r["isinstance_torch_ddp"]
        assert not r["replaced_after"]  # the swap ended with the with-block around prepare()
        assert r["synced"] == expected["synced"] and r["optimizer_steps"] == expected["optimizer_steps"]
        assert_identical(r["weights"], expected["weights"], f"{loop}: gradsync rank {rank}")


def test_gradsync_num_items_matches_accelerates_token_recipe(torch_run, gradsync_run):
    """Either normalization gives the exact token mean; so the two must never be combined."""
    expected = torch_run["tokens"][0]
    for rank, r in enumerate(gradsync_run["num_items"]):
        assert r["synced"] == expected["synced"] and r["optimizer_steps"] == 3
        for name, value in r["weights"].items():  # rounding differs: the scale is applied elsewhere
            torch.testing.assert_close(value, expected["weights"][name], rtol=0, atol=1e-6,
                                       msg=lambda m, name=name, rank=rank: f"rank {rank} {name}: {m}")
