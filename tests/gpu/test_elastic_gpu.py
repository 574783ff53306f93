"""Elastic membership on a GPU (``make test-gpu``): replicas SIGKILLed with a bucket in flight.

Written without a GPU at hand and not yet run. With one GPU, two replicas share it over gloo with CUDA
tensors (NCCL refuses two ranks on one device); with two or more, the drill runs on NCCL, where a
survivor's kernel that waits on the dead peer is released by aborting the old group
(``ProcessGroup.abort``, ``elastic/membership.py`` ``reform``) before the next generation forms.
"""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "elastic"))
from test_elastic import check_run, launch  # noqa: E402

# device_count() asks NVML and leaves the driver alone: is_available() would initialize CUDA in pytest, and
# the replicas that `gradsync run` forks from it could then not use the GPU
pytestmark = pytest.mark.skipif(torch.cuda.device_count() == 0, reason="needs a CUDA device")


def test_elastic_drill_with_cuda_tensors_over_gloo(tmp_path):
    proc = launch(tmp_path, "--victim", "2", "--window", "1", "--point", "during_reductions", "--device", "cuda")
    check_run(tmp_path, proc, victim=2, window=1)


@pytest.mark.parametrize("point,victim,window,lost", [("during_reductions", 2, 1, 3), ("optimizer_step", 1, 2, 0)])
def test_sharded_elastic_drill_with_cuda_tensors_over_gloo(tmp_path, point, victim, window, lost):
    """ShardedDataParallel + ShardedOptimizer(AdamW) with each shard on two members: the re-shard moves the
    survivors' shards through the CPU and back onto the GPU."""
    proc = launch(tmp_path, "--victim", str(victim), "--window", "1", "--point", point, "--device", "cuda", "--sharded")
    check_run(tmp_path, proc, victim=victim, window=window, lost=lost, adamw=True)


@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="NCCL needs a GPU per replica: 3 replicas, 3 GPUs")
def test_elastic_drill_on_nccl_aborts_the_old_group(tmp_path):
    proc = launch(tmp_path, "--victim", "2", "--window", "1", "--point", "during_reductions", "--device", "cuda",
                  "--backend", "nccl")
    check_run(tmp_path, proc, victim=2, window=1)
