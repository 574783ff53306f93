"""Lightning Trainer(strategy="ddp") on 2 CPU ranks: torch's DDP and gradsync train to the same weights."""
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning", reason="lightning is not installed: pip install torch==2.13.0 -e '.[compat]'")

from compat_proc import run_bounded  # noqa: E402

pytestmark = pytest.mark.compat
SCRIPT = Path(__file__).with_name("lightning_fit.py")
TIMEOUT = 300  # the two fits take ~20 s on 2 cores (Lightning starts rank 1 as a fresh interpreter)


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    """torch's fit, then gradsync's, one after another in one launch (each launch costs two
    interpreters importing Lightning)."""
    out = tmp_path_factory.mktemp("lightning")
    proc = run_bounded([sys.executable, str(SCRIPT), "torch,gradsync", str(out)], TIMEOUT, log=out / "log")
    assert not proc.timed_out, f"Lightning fits ran past {TIMEOUT}s\n{proc.tail}"
    result = {}
    for mode in ("torch", "gradsync"):
        ranks = []
        for r in range(2):
            f = out / mode / f"rank{r}.pt"
            assert f.exists(), f"{mode}: rank {r} did not finish training (exit {proc.returncode})\n{proc.tail}"
            ranks.append(torch.load(f, weights_only=False))
        done = all((out / mode / f"rank{r}.done").exists() for r in range(2))
        result[mode] = {"ranks": ranks, "returncode": proc.returncode, "done": done, "tail": proc.tail}
    return result


@pytest.fixture(scope="module")
def torch_fit(fits):
    return fits["torch"]


@pytest.fixture(scope="module")
def gradsync_fit(fits):
    return fits["gradsync"]


def test_lightning_wraps_the_model_in_gradsync(torch_fit, gradsync_fit):
    for r in torch_fit["ranks"]:
        assert r["wrapped_in"] == ("torch.nn.parallel.distributed.DistributedDataParallel", True)
    for r in gradsync_fit["ranks"]:
        assert r["wrapped_in"] == ("gradsync.ddp.compat.DistributedDataParallel", True)
    assert torch_fit["done"], torch_fit["tail"]  # torch's fit returned (the launch's exit: gradsync's test)


def test_lightning_ddp_fit_gives_torchs_weights(torch_fit, gradsync_fit):
    # 2 epochs of 10 micro-batches per rank, accumulate_grad_batches=4: windows 4, 4, 2 -> 6 steps
    for r in torch_fit["ranks"] + gradsync_fit["ranks"]:
        assert r["optimizer_steps"] == 6 and r["global_step"] == 6, r
    expected = torch_fit["ranks"][0]["weights"]
    for rank, r in enumerate(gradsync_fit["ranks"]):
        assert r["weights"].keys() == expected.keys()
        for name, value in r["weights"].items():
            # bit-identical today; the contract is fp32 equivalence
            torch.testing.assert_close(value, expected[name], atol=1e-6, rtol=0,
                                       msg=lambda m, name=name, rank=rank: f"rank {rank} {name}: {m}")
    for name, value in gradsync_fit["ranks"][1]["weights"].items():
        assert torch.equal(value, gradsync_fit["ranks"][0]["weights"][name]), f"ranks disagree on {name}"


def test_lightning_fit_returns_on_gradsync(gradsync_fit):
    # Lightning's DDPStrategy.teardown() reads model._get_ddp_logging_data() (torch-private)
    assert gradsync_fit["returncode"] == 0 and gradsync_fit["done"], gradsync_fit["tail"]
