import sys
from pathlib import Path

# Test this checkout's sources even when another checkout is installed in the environment.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # helpers.py, from every test folder

import torch  # noqa: E402
import torch.testing  # noqa: F401  (imported before forking: children use it)

import gradsync  # noqa: F401,E402

# Ranks are forked from this process; one intra-op thread keeps OpenMP fork-safe and the
# 2-core machine from oversubscribing.
torch.set_num_threads(1)

# Forked ranks inherit what the parent imported. An optimizer's first step imports torch._dynamo
# (about a second), so pay that once here rather than in every rank of every test.
_warm = torch.nn.Parameter(torch.zeros(1))
_warm.grad = torch.zeros(1)
torch.optim.Adam([_warm]).step()
del _warm
