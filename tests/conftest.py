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

# The longest files first. `make test` runs two workers with --dist loadfile, which hands out whole files
# in collection order as workers free up; a long file collected last (tests/tools sorts last) kept one
# worker busy for minutes after the other had finished. Longest first leaves only short files for the end.
LONGEST_FIRST = ("ddp/test_compile.py", "elastic/test_elastic.py", "tools/test_benchmark_scripts.py",
                 "tools/test_run.py", "compat/test_torch_ddp_tests.py", "compat/test_clean_exit.py",
                 "accumulate/test_noise_scale.py", "compat/test_lightning_strategy.py", "tools/test_wheel.py")


def pytest_collection_modifyitems(items):
    first = {name: k for k, name in enumerate(LONGEST_FIRST)}
    # a stable sort: tests keep their order within a file, and the other files theirs
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0].removeprefix("tests/"), len(first)))
