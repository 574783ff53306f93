"""Trainer/Fabric(strategy="gradsync") on 2 CPU ranks, without replace_torch_ddp(): torch's weights, bit for bit."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning", reason="lightning is not installed: pip install torch==2.13.0 -e '.[lightning]'")

from compat_proc import SRC, run_bounded  # noqa: E402

pytestmark = pytest.mark.compat
HERE = Path(__file__).parent
TIMEOUT = 400  # the 11 fits take ~60 s on 2 idle cores (rank 1 is a fresh interpreter)


def run(script, modes, out):
    """Run ``modes`` one after another in one 2-rank launch of ``script``: {mode: [rank 0's, rank 1's]}."""
    proc = run_bounded([sys.executable, str(HERE / script), ",".join(modes), str(out)], TIMEOUT, log=out / "log")
    assert not proc.timed_out, f"{script} {modes}: ran past {TIMEOUT}s\n{proc.tail}"
    result = {}
    for mode in modes:
        ranks = []
        for r in range(2):
            done = out / mode / f"rank{r}.done"
            assert done.exists(), f"{script} {mode}: rank {r} did not finish\n{proc.tail}"
            ranks.append(torch.load(out / mode / f"rank{r}.pt", weights_only=False))
            ranks[-1]["done"] = done.read_text()
            syncs = out / mode / f"syncs{r}.txt"
            if syncs.exists():
                ranks[-1]["syncs"] = int(syncs.read_text())
        result[mode] = ranks
    assert proc.returncode == 0, proc.tail
    return result


def assert_same_weights(got, expected, atol=0.0):
    """Every rank's weights equal ``expected``'s: bit for bit, or within ``atol``; ranks agree bitwise."""
    for rank, r in enumerate(got):
        assert r["weights"].keys() == expected["weights"].keys()
        for name, value in r["weights"].items():
            diff = (value - expected["weights"][name]).abs().max().item()
            assert torch.equal(value, expected["weights"][name]) or diff <= atol, (
                f"rank {rank} {name}: max diff {diff:g}")
            assert torch.equal(value, got[0]["weights"][name]), f"ranks 0 and {rank} disagree on {name}"


# Sharded runs clip (gradient_clip_val / fabric.clip_gradients) by a global norm summed over shards,
# in another order than torch's clip_grad_norm_: equal up to rounding (seen: 1e-9), not bit for bit.
SHARDED_ATOL = 1e-6


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    """Lightning fits: torch's "ddp", "gradsync", manual optimization on "gradsync", and 1 epoch +
    resume to 2 with GradsyncStrategy(...) options and with "gradsync_sharded"; one after another in
    one launch (each launch costs two interpreters importing Lightning). "gradsync" goes first: its
    strategy starts rank 1 and forms the process group; the later fits find both in place."""
    return run("lightning_strategy_fit.py", ("gradsync", "ddp", "manual_gradsync", "part1", "resume",
                                             "part1_sharded", "resume_sharded", "amp_ddp", "amp_sharded", "value_ddp",
                                             "value_sharded"),
               tmp_path_factory.mktemp("fits"))


@pytest.fixture(scope="module")
def loops(tmp_path_factory):
    """Fabric loops with no_backward_sync: "gradsync" (its strategy launches), torch's "ddp",
    "gradsync_sharded", in one launch."""
    return run("fabric_loop.py", ("gradsync", "ddp", "gradsync_sharded", "amp_ddp", "amp_sharded", "value_ddp", "value_sharded"),
               tmp_path_factory.mktemp("fabric"))


def test_trainer_strategy_gradsync_gives_ddps_weights(fits):
    # 2 epochs of 10 micro-batches per rank, accumulate_grad_batches=4: windows 4, 4, 2 -> 6 steps
    torch_ranks = fits["ddp"]
    assert torch_ranks[0]["wrapped_in"] == ("torch.nn.parallel.distributed.DistributedDataParallel", True)
    for mode, wrapper in (("gradsync", "gradsync.ddp.wrapper.DistributedDataParallel"),
                          ("part1_sharded", "gradsync.sharded.wrapper.ShardedDataParallel")):
        for r in fits[mode]:
            assert r["wrapped_in"] == (wrapper, False), r["wrapped_in"]  # built by the strategy, no class swap
            assert "torch ddp replaced: False" in r["done"]
    for r in fits["gradsync"]:
        assert r["optimizer_steps"] == 6 and r["global_step"] == 6, r
    assert_same_weights(fits["gradsync"], torch_ranks[0])


def test_trainer_accumulation_blocks_sync_with_gradsyncs_no_sync(fits):
    # one all-reduced bucket per window, as torch's DDP: micro-steps inside a window do not communicate
    assert [r["syncs"] for r in fits["ddp"]] == [6, 6]
    assert [r["syncs"] for r in fits["gradsync"]] == [6, 6]


def test_trainer_manual_optimization_accumulates_with_toggle_model(fits):
    # manual_backward runs inside the wrapper's forward; the strategy's pre_backward prepares it.
    # The manual loop does the automatic loop's arithmetic (loss / 4, step per window): same bits.
    for r in fits["manual_gradsync"]:
        assert r["optimizer_steps"] == 6 and r["syncs"] == 6, r
    assert_same_weights(fits["manual_gradsync"], fits["ddp"][0])


def test_trainer_resume_from_checkpoint_matches_an_uninterrupted_fit(fits):
    for r in fits["part1"]:  # its counting hook came as GradsyncStrategy(ddp_comm_hook=...), on CPU
        assert r["global_step"] == 3 and r["syncs"] == 3
    for mode in ("resume", "resume_sharded"):
        for r in fits[mode]:
            assert r["global_step"] == 6 and r["optimizer_steps"] == 3, r  # 3 restored, 3 run
    assert_same_weights(fits["resume"], fits["gradsync"][0])


def test_trainer_gradsync_sharded_resumed_gives_ddps_weights(fits):
    # ShardedOptimizer saves the full optimizer state (torch's format) and loads it back sharded;
    # gradient_clip_val clips the shards by the global norm (unclipped, the weights differ by 0.07)
    assert_same_weights(fits["resume_sharded"], fits["ddp"][0], atol=SHARDED_ATOL)


def test_fp16_loss_scaling_on_gradsync_sharded_gives_ddps_weights(fits, loops):
    """MixedPrecision("16-mixed"): the plugin's torch GradScaler (which finds no gradient on a ShardedOptimizer's shard
    pieces and raises) becomes a gradsync.ShardedGradScaler; the same steps and weights as torch's DDP and scaler."""
    for runs in (fits, loops):
        for r in runs["amp_sharded"]:
            assert "scaler: ShardedGradScaler" in r["done"] and r["optimizer_steps"] == runs["amp_ddp"][0]["optimizer_steps"]
        assert "scaler: GradScaler" in runs["amp_ddp"][0]["done"]
        assert_same_weights(runs["amp_sharded"], runs["amp_ddp"][0], atol=SHARDED_ATOL)


def test_fabric_no_backward_sync_gives_ddps_weights(loops):
    torch_ranks = loops["ddp"]
    assert torch_ranks[0]["syncs"] == 6 and torch_ranks[0]["optimizer_steps"] == 6
    for mode in ("gradsync", "gradsync_sharded"):
        for r in loops[mode]:
            assert r["wrapped_in"][1] is False and r["wrapped_in"][0].startswith("gradsync.")
            assert r["done"] == "restored: True\n"  # fabric.save/load round trip
        assert_same_weights(loops[mode], torch_ranks[0], atol=SHARDED_ATOL if mode.endswith("sharded") else 0.0)
    assert [r["syncs"] for r in loops["gradsync"]] == [6, 6]


def test_import_gradsync_does_not_import_lightning():
    probe = "import sys, gradsync; print('lightning' in sys.modules, 'gradsync.lightning' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         timeout=120, env=env).stdout.split()
    assert out == ["False", "False"]


def test_import_registers_trainer_and_fabric_names():
    import gradsync.lightning as gl
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    for name, sharded in (("gradsync", False), ("gradsync_sharded", True)):
        assert isinstance(StrategyRegistry.get(name), gl.GradsyncStrategy)
        assert StrategyRegistry.get(name).sharded is sharded
        assert isinstance(STRATEGY_REGISTRY.get(name), gl.GradsyncFabricStrategy)
    assert StrategyRegistry["ddp"]["strategy"] is not gl.GradsyncStrategy  # Lightning's names untouched
    strategy = gl.GradsyncStrategy(reduce_dtype=torch.float32, sync_timeout=60, timeout=None)
    assert strategy._gradsync_options == {"reduce_dtype": torch.float32, "timeout": 60}


@pytest.mark.parametrize("cls", ["GradsyncStrategy", "GradsyncFabricStrategy"])
def test_bad_options_fail_at_construction_naming_the_option(cls):
    import gradsync.lightning as gl

    strategy = getattr(gl, cls)
    with pytest.raises(TypeError, match=r"unknown option 'reduce_dtpye' \(did you mean 'reduce_dtype'\?\)"):
        strategy(reduce_dtpye=torch.float32)
    with pytest.raises(TypeError, match="unknown option 'bogus'.*gradsync's options: .*bucket_cap_mb"):
        strategy(bogus=1)
    with pytest.raises(TypeError, match="'max_inflight' is an option of gradsync.ShardedDataParallel"):
        strategy(max_inflight=4)
    with pytest.raises(TypeError, match="'device_ids' is set by the strategy"):
        strategy(device_ids=[0])
    with pytest.raises(TypeError, match="reduce_dtype must be a floating-point torch.dtype"):
        strategy(reduce_dtype="float32")
    assert strategy(sharded=True, max_inflight=4)._gradsync_options == {"max_inflight": 4}


def test_trainer_with_a_bad_option_fails_before_starting_ranks():
    import lightning as L

    import gradsync.lightning as gl

    with pytest.raises(TypeError, match="unknown option 'find_unused_parameter'"):
        L.Trainer(strategy=gl.GradsyncStrategy(find_unused_parameter=True), accelerator="cpu", devices=2)


def test_sharded_clipping_by_value_gives_ddps_weights(fits, loops):
    """gradient_clip_algorithm="value" (Trainer) and clip_val= (Fabric): each rank clamps its own gradient shards."""
    for runs in (fits, loops):
        assert runs["value_sharded"][0]["optimizer_steps"] == runs["value_ddp"][0]["optimizer_steps"]
        assert_same_weights(runs["value_sharded"], runs["value_ddp"][0], atol=SHARDED_ATOL)
