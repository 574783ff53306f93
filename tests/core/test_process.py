"""core/process.py: every process-wide effect is registered, idempotent and reversible; constructing a
wrapper does not import torch's compiler, and Dynamo still skips the wrapper once it is imported."""
import os
import subprocess
import sys
from pathlib import Path

import gradsync
from gradsync.core import process

SRC = str(Path(gradsync.__file__).parent.parent)


def run_fresh(code: str) -> str:
    """Run ``code`` in a new interpreter (no module imported by the test process); return its stdout."""
    env = {**os.environ, "PYTHONPATH": SRC}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


WRAP_ONE_RANK = """
import os, sys, tempfile, torch, torch.distributed as dist
import gradsync
store = tempfile.mktemp()
dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
model = gradsync.DistributedDataParallel(torch.nn.Linear(4, 2))
model(torch.randn(3, 4)).sum().backward()
"""


def test_wrapping_does_not_import_the_compiler():
    # importing torch._dynamo at construction cost ~2 s per process and delayed construction errors
    out = run_fresh(WRAP_ONE_RANK + "print('torch._dynamo' in sys.modules)")
    assert out.split()[0] == "False"


def test_dynamo_skips_the_wrapper_once_imported_later():
    code = WRAP_ONE_RANK + """
from gradsync.core import process
assert 'torch._dynamo' not in sys.modules
import torch._dynamo.trace_rules as rules
core = os.path.dirname(gradsync.core.__file__) + os.sep
print(any(d.rstrip(os.sep) == core.rstrip(os.sep) for d in rules.SKIP_DIRS), process.installed())
process.uninstall_all()
print(any(d.rstrip(os.sep) == core.rstrip(os.sep) for d in rules.SKIP_DIRS), process.installed())
"""
    first, second = run_fresh(code).strip().splitlines()
    assert first.startswith("True") and "dynamo-skip:gradsync.core" in first
    assert second == "False []"


def test_effects_install_once_and_undo():
    calls = []
    effect = process.Effect(name="test-effect", reason="a test", apply=lambda: calls.append("apply"),
                            undo=lambda: calls.append("undo"))
    process.install(effect)
    process.install(process.Effect(name="test-effect", reason="a test", apply=lambda: calls.append("again"),
                                   undo=lambda: None))
    assert "test-effect" in process.installed()
    process.uninstall("test-effect")
    process.uninstall("test-effect")
    assert calls == ["apply", "undo"] and "test-effect" not in process.installed()
