"""The CPU port of torch's GPU-gated DDP tests (``distributed_test.py``), applied in this process.

Rules (the same in every mode: torch's DDP, ``replace_torch_ddp()``, the class assignment):

1. Gates. The accelerator gates are removed from a test's decorator chain: the wrappers made by
   ``skip_if_lt_x_gpu``, ``nccl_skip_if_lt_x_gpu``, ``skip_if_no_gpu`` and
   ``require_n_gpus_for_nccl_backend`` are cut out of the ``__wrapped__`` chain (the outer
   decorator's closure is pointed at the inner function); a skip set at import by
   ``require_backend_is_available({"nccl"})`` ("Test requires backend gloo to be one of ...") is
   lifted. Every other skip stays (the issue-numbered ones, ``skip_if_small_worldsize``, ROCm, ...).
2. Devices. Inside a ported test (in each rank) a ``TorchFunctionMode`` sends every CUDA device to
   the CPU: a ``device=`` keyword that is an int, a ``"cuda..."`` string or a CUDA ``torch.device``,
   and a positional device of ``Tensor.to`` and ``nn.Module.to``; ``Tensor.cuda()`` returns the tensor itself. So
   ``model.cuda(rank)``, ``model.to(rank)``, ``torch.randn(..., device=rank)`` build CPU tensors.
   ``torch.cuda.set_device``/``synchronize``/``manual_seed``/``empty_cache`` do nothing,
   ``torch.cuda.current_device()`` is 0, and ``init_multigpu_helper`` gives rank r the "GPU" [r].
   ``torch.cuda.is_available()`` and ``device_count()`` stay as they are (torch's DDP reads them).
3. Wrapper arguments. ``device_ids`` and ``output_device`` are dropped when the wrapped module's
   parameters are all on the CPU (as a CPU model is wrapped: torch refuses them there); every
   other argument goes through unchanged, to whichever class the test builds.

A test ported this way is kept only if torch's own DDP passes it (``torch_ddp_tests.py`` runs
torch first); which ones and why the others are left out is in ``tests/compat/torch_ddp_tests.md``.
"""
from __future__ import annotations

import functools
import re
from typing import Any

GATES = ("skip_if_lt_x_gpu.", "nccl_skip_if_lt_x_gpu.", "skip_if_no_gpu.", "require_n_gpus_for_nccl_backend.")
BACKEND_SKIP = re.compile(r"^Test requires backend \w+ to be one of ")


def _is_gate(fn: Any) -> bool:
    code = getattr(fn, "__code__", None)
    return code is not None and code.co_qualname.startswith(GATES)


def _cut_gates(fn: Any) -> tuple[Any, bool]:
    """Return ``fn`` with the gate wrappers cut out of its decorator chain, and whether one was."""
    cut = False
    while _is_gate(fn) and hasattr(fn, "__wrapped__"):
        fn, cut = fn.__wrapped__, True
    outer = fn
    while hasattr(outer, "__wrapped__"):
        inner = outer.__wrapped__
        if _is_gate(inner):
            target = inner
            while _is_gate(target) and hasattr(target, "__wrapped__"):
                target = target.__wrapped__
            for cell in outer.__closure__ or ():
                if cell.cell_contents is inner:
                    cell.cell_contents = target
            outer.__wrapped__ = target
            cut = True
            continue
        outer = inner
    return fn, cut


def _backend_skipped(fn: Any) -> bool:
    return getattr(fn, "__unittest_skip__", False) and bool(
        BACKEND_SKIP.match(getattr(fn, "__unittest_skip_why__", "") or ""))


def port_tests(cls: type, names: list[str]) -> list[str]:
    """Port ``names`` of ``cls`` in place (rules 1 and 2); return the names a rule changed."""
    ported = []
    for name in names:
        fn = cls.__dict__.get(name) or getattr(cls, name)
        fn, cut = _cut_gates(fn)
        lifted = False
        f = fn
        while f is not None:
            if _backend_skipped(f):
                f.__unittest_skip__ = False
                lifted = True
            f = getattr(f, "__wrapped__", None)
        if not (cut or lifted):
            continue
        setattr(cls, name, _on_cpu(fn))
        ported.append(name)
    return ported


def _on_cpu(fn: Any) -> Any:
    @functools.wraps(fn)
    def test(*args: Any, **kwargs: Any) -> Any:
        with CpuDevices():
            return fn(*args, **kwargs)
    test.__unittest_skip__ = False  # wraps() copied a lifted backend skip's attributes
    return test


def _cpu(device: Any) -> Any:
    import torch
    if isinstance(device, bool):
        return device
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _mode_class():
    import torch
    from torch.overrides import TorchFunctionMode

    to_methods = {torch.Tensor.to, torch._C._nn._parse_to}  # _parse_to: nn.Module.to's arguments
    cuda_methods = {torch.Tensor.cuda}

    class _CpuDevices(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func in cuda_methods:
                return args[0]
            if "device" in kwargs:
                kwargs["device"] = _cpu(kwargs["device"])
            if func in to_methods:  # (self,) device, dtype, ...: only a device-like argument changes
                args = tuple(_cpu(a) if not isinstance(a, (torch.dtype, torch.Tensor)) else a for a in args)
            return func(*args, **kwargs)

    return _CpuDevices


_MODE = None


def CpuDevices():  # noqa: N802 (a context manager, like the class it returns)
    global _MODE
    if _MODE is None:
        _MODE = _mode_class()
    return _MODE()


def patch_cuda_helpers(test_module: Any, world_size: int) -> None:
    """Rule 2's process-wide part (this runner's process and its forked ranks only)."""
    import torch
    for name in ("set_device", "synchronize", "manual_seed", "manual_seed_all", "empty_cache"):
        setattr(torch.cuda, name, lambda *a, **k: None)
    torch.cuda.current_device = lambda: 0
    rank_to_gpu = {r: [r] for r in range(world_size)}
    test_module.init_multigpu_helper = lambda *a, **k: {r: list(g) for r, g in rank_to_gpu.items()}


def drop_device_ids(cls: type) -> None:
    """Rule 3 on ``cls.__init__`` (torch's class, patched or not, or gradsync's)."""
    original = cls.__init__
    if getattr(original, "_gradsync_port", False):
        return

    @functools.wraps(original)
    def __init__(self, module, *args, **kwargs):
        params = list(module.parameters())
        if params and all(p.device.type == "cpu" for p in params):
            if args:  # device_ids, output_device are the first two positional arguments
                args = (None, None, *args[2:]) if len(args) >= 2 else (None,)
            kwargs.pop("device_ids", None)
            kwargs.pop("output_device", None)
        original(self, module, *args, **kwargs)

    __init__._gradsync_port = True
    cls.__init__ = __init__
