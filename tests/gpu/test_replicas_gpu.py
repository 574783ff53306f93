"""``check_replicas`` on a GPU (``make test-gpu``): no host sync in a steady-state step, and a flipped bit on
one of three ranks (sharing the GPU over gloo with CUDA tensors) caught within two optimizer steps.

Off the CPU the fingerprints travel one synced backward late (``engine/replicas.py``, ``lag``): reading
them back at once would stall the host on the device every step.
"""
import sys
from pathlib import Path

import pytest
import torch

import gradsync
from gradsync.tools.launch import run_ranks

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from test_gpu import steady_state  # noqa: E402
from test_replicas import train  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.device_count() == 0, reason="needs a CUDA device")


def checked(module, _):
    return gradsync.DDP(module, device_ids=[module[0].weight.device.index], check_replicas=True)


@pytest.mark.parametrize("accum", [1, 4])
def test_check_replicas_makes_no_host_sync(accum):
    assert run_ranks(steady_state, 1, checked, accum, backend="nccl") == [True]


def train_on_gpu(rank, world_size, *args):
    torch.cuda.set_device(0)
    return train(rank, world_size, *args, device="cuda")


@pytest.mark.parametrize("fault,hook", [("parameter", False), ("gradient", True), ("state", False)])
def test_a_flipped_bit_on_one_rank_of_three_is_caught_within_two_steps(fault, hook):
    results = run_ranks(train_on_gpu, 3, 10, fault, 3, 2, True, hook, backend="gloo", start_method="spawn",
                        timeout=240)
    for done, error, message, _ in results:
        assert error == "ReplicaMismatchError", (fault, done, message)
        assert 3 <= done <= 5, (fault, done)  # at most two optimizer steps after the fault
        assert "rank(s) [2] disagree with the majority of ranks [0, 1, 2]" in message, message
    assert len({r[:3] for r in results}) == 1


def test_clean_training_on_the_gpu_is_bit_identical_to_unchecked():
    checked_run = run_ranks(train_on_gpu, 3, 8, backend="gloo", start_method="spawn", timeout=240)
    unchecked = run_ranks(train_on_gpu, 3, 8, None, 3, None, False, backend="gloo", start_method="spawn", timeout=240)
    for (done, error, _, params), (_, _, _, ref) in zip(checked_run, unchecked):
        assert done == 8 and error is None
        assert all(torch.equal(params[n], ref[n]) for n in ref)
