"""process.py: every process-wide effect is registered, idempotent and reversible; constructing a
wrapper does not import torch's compiler, and Dynamo still skips the wrapper once it is imported."""
import os
import subprocess
import sys
from pathlib import Path

import gradsync
from gradsync import process

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
from gradsync import process
assert 'torch._dynamo' not in sys.modules
import torch._dynamo.trace_rules as rules
core = os.path.dirname(gradsync.engine.__file__) + os.sep
print(any(d.rstrip(os.sep) == core.rstrip(os.sep) for d in rules.SKIP_DIRS), process.installed())
process.uninstall_all()
print(any(d.rstrip(os.sep) == core.rstrip(os.sep) for d in rules.SKIP_DIRS), process.installed())
"""
    first, second = run_fresh(code).strip().splitlines()
    assert first.startswith("True") and "dynamo-skip:gradsync.engine" in first
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


PRISTINE = """
import atexit, gc, os, sys, tempfile, torch, torch.distributed as dist
import torch.nn.utils.clip_grad as clip_grad, torch.optim.optimizer as optim_mod
from torch.nn.parallel.distributed import DistributedDataParallel as TorchDDP
before = dict(clip=torch.nn.utils.clip_grad_norm_, clip_module=clip_grad.clip_grad_norm_,
              pre_hooks=dict(optim_mod._global_optimizer_pre_hooks), init=vars(TorchDDP)["__init__"],
              meta_path=list(sys.meta_path))
calls, real_register, real_unregister = [], atexit.register, atexit.unregister
atexit.register = lambda f, *a, **k: (calls.append(("register", f.__name__)), real_register(f, *a, **k))[1]
atexit.unregister = lambda f: (calls.append(("unregister", f.__name__)), real_unregister(f))[1]
import gradsync
from gradsync import process
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
handle = gradsync.replace_torch_ddp()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))  # gradsync's, through torch's name
opt = torch.optim.SGD(model.parameters(), lr=0.1)
overlapped = gradsync.overlap_optimizer(model, opt)
model(torch.randn(3, 4)).sum().backward()
opt.step()
sharded = gradsync.ShardedDataParallel(torch.nn.Linear(4, 2))
sharded_opt = gradsync.ShardedOptimizer(sharded, torch.optim.SGD, lr=0.1)
sharded(torch.randn(3, 4)).sum().backward()
torch.nn.utils.clip_grad_norm_(sharded.parameters(), 1.0)
sharded_opt.step()
print(" ".join(process.installed()))
del model, opt, overlapped, sharded, sharded_opt
gc.collect()
print(" ".join(process.installed()))  # the clip patch went with its last owner
process.uninstall_all()
print([c for c in calls if c[1] == "_release_gil_before_shutdown"], process.installed())
handle.undo()  # spent by uninstall_all: a no-op
rules = sys.modules.get("torch._dynamo.trace_rules")
package = os.path.dirname(gradsync.__file__)
print(torch.nn.utils.clip_grad_norm_ is before["clip"], clip_grad.clip_grad_norm_ is before["clip_module"],
      dict(optim_mod._global_optimizer_pre_hooks) == before["pre_hooks"],
      vars(TorchDDP)["__init__"] is before["init"], not handle.active,
      sys.meta_path == before["meta_path"],
      rules is None or not any(d.startswith(package) for d in rules.SKIP_DIRS))
"""


def test_every_effect_is_listed_and_uninstall_all_leaves_torch_pristine():
    during, after_delete, uninstalled, pristine = run_fresh(PRISTINE).strip().splitlines()
    assert set(during.split()) >= {"clip_grad_norm_", "exit-hook", "optimizer-step-guard", "replace-torch-ddp"}
    assert "clip_grad_norm_" not in after_delete.split() and "replace-torch-ddp" in after_delete.split()
    hook = "'_release_gil_before_shutdown'"
    assert uninstalled == f"[('register', {hook}), ('unregister', {hook})] []"  # registered once, then undone
    assert pristine.split() == ["True"] * 7


def test_clip_grad_norm_patch_lives_while_an_owner_does():
    import gc

    import torch

    original, original_value = torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad_value_

    class Owner:
        def __init__(self, answer):
            self.answer, self.asked = answer, 0

        def clip_grad_norm_for(self, params, max_norm, norm_type, error_if_nonfinite, foreach):
            self.asked += 1
            return self.answer

    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    passing, answering = Owner(None), Owner(torch.tensor(7.0))
    process.claim_clip_grad_norm(passing)
    process.claim_clip_grad_norm(answering)
    process.claim_clip_grad_norm(passing)  # idempotent
    assert torch.nn.utils.clip_grad_norm_ is not original and "clip_grad_norm_" in process.installed()
    assert torch.nn.utils.clip_grad_value_ is not original_value
    assert torch.nn.utils.clip_grad.clip_grad_value_ is torch.nn.utils.clip_grad_value_  # one replacement, both names
    assert torch.nn.utils.clip_grad_norm_([p], 1.0).item() == 7.0 and passing.asked == answering.asked == 1
    process.release_clip_grad_norm(answering)
    assert torch.nn.utils.clip_grad_norm_([p], 1.0).item() > 3.0  # torch's own: the norm before clipping
    del passing
    gc.collect()
    assert torch.nn.utils.clip_grad_norm_ is original and "clip_grad_norm_" not in process.installed()
    assert torch.nn.utils.clip_grad_value_ is original_value is torch.nn.utils.clip_grad.clip_grad_value_
