"""The package's tiers: core <- layers <- tools, and ``import gradsync`` loads no tool."""
import subprocess
import sys

import pytest

PROBE = """
import sys, torch
before = set(sys.modules)
import {module}
print(" ".join(sorted(set(sys.modules) - before)))
"""


def loaded_by(module: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", PROBE.format(module=module)], capture_output=True, text=True,
                         check=True, timeout=120)
    return set(out.stdout.split())


@pytest.mark.parametrize("module,forbidden", [
    ("gradsync", ("gradsync.tools", "matplotlib", "tqdm", "numpy")),
    ("gradsync.core", ("gradsync.layers", "gradsync.tools")),
    ("gradsync.layers", ("gradsync.tools",)),
])
def test_imports_point_one_way(module, forbidden):
    new = loaded_by(module)
    assert module in new  # the probe saw the import
    assert not [m for m in new if m.startswith(forbidden)]
