import sys
from pathlib import Path

# Test this checkout's sources even when another checkout is installed in the environment.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.testing  # noqa: F401  (imported before forking: children use it)

import gradsync  # noqa: F401,E402

# Ranks are forked from this process; one intra-op thread keeps OpenMP fork-safe and the
# 2-core machine from oversubscribing.
torch.set_num_threads(1)
