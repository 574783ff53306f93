import torch
import torch.testing  # noqa: F401  (imported before forking: children use it)

import gradsync  # noqa: F401

# Ranks are forked from this process; one intra-op thread keeps OpenMP fork-safe and the
# 2-core machine from oversubscribing.
torch.set_num_threads(1)
