"""Every private torch API gradsync uses, bound once, each with what breaks without it.

Nothing else in gradsync names a torch attribute that starts with an underscore (tests/test_layout.py checks).
Torch's classes and functions are bound here at import, so a user's assignment (``torch.nn.parallel.DistributedDataParallel
= gradsync.DistributedDataParallel``) or a framework's patch of a namespace cannot change what gradsync calls. Checked on
torch 2.13.0 (development pin) and 2.14.1 (``make test-torch-next``) unless an entry says otherwise; 2.13 is the declared
floor, the oldest release the suite has passed on (gradsync/_torch_range.py warns outside the tested range).
"""
from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from operator import attrgetter
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel.distributed import DistributedDataParallel as TORCH_DDP

TorchDDP = TORCH_DDP  # torch's class itself, not what its name is now: Dynamo reads it; compat.py redirects it

Future = torch._C.Future  # torch.futures.Future's C base: what a Work's get_future() returns, not the Python subclass
_engine = torch.autograd.Variable._execution_engine
graph_task_id = torch._C._current_graph_task_id  # () -> -1 outside a backward: the step guard refuses a step inside one


def is_future(handle: Any) -> bool:
    """True for a future (a comm hook's result), False for a ``dist.Work``."""
    return isinstance(handle, Future)


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the autograd engine finishes the current backward (torch's reducer does the same in
    C++). Without it the end of backward is never seen and nothing is reduced. Compiled autograd never runs such
    callbacks: see ``in_compiled_autograd``."""
    _engine.queue_callback(callback)


def post_accumulate_hooks(param: torch.Tensor, pre: bool = False) -> Any:
    """``param``'s ordered dict of post-accumulate-grad hooks (``pre``: of tensor hooks, run before AccumulateGrad)."""
    return param._backward_hooks if pre else param._post_accumulate_grad_hooks


def ddp_markings(module: torch.nn.Module) -> tuple[set[str], list[str]]:
    """What torch's DDP reads off a module: names ``DDP._set_params_and_buffers_to_ignore_for_model`` marked, and the
    parameters ``torch.distributed.optim._apply_optimizer_in_backward`` gave an optimizer step in their backward."""
    return (set(getattr(module, "_ddp_params_and_buffers_to_ignore", ())),
            [n for n, p in module.named_parameters() if getattr(p, "_in_backward_optimizers", None)])


def in_compiled_autograd() -> bool:
    """True while compiled autograd runs a backward (its engine skips queued callbacks)."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return ca is not None and ca.in_compiled_autograd_region


def has_cpu_backend(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` can all-reduce CPU tensors (gloo, or CPU beside NCCL); else the control plane gets its own (groups.py)."""
    try:
        group._get_backend(torch.device("cpu"))
    except (RuntimeError, AttributeError, ValueError):
        return False
    return True


def group_timeout(group: dist.ProcessGroup, device: torch.device) -> timedelta:
    """The group's own timeout for ``device``'s backend, else torch's default (not its 30 minutes if shorter)."""
    try:
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return dist.default_pg_timeout


def default_first_bucket_bytes() -> int:
    """torch's first-bucket cap (1 MiB since torch 1.x); 1 MiB where distributed is unavailable."""
    return getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 1024 * 1024) if dist.is_available() else 1024 * 1024


@contextlib.contextmanager
def active_ddp_module(module: Any, first_bucket_bytes: int) -> Iterator[None]:
    """Inside, Dynamo's DDP optimizer splits compiled graphs at ``module.bucket_bytes_cap`` and ``first_bucket_bytes``
    (``convert_frame.py`` reads ``TorchDDP._get_active_ddp_module()``, ``backends/distributed.py`` torch's first cap).
    Without it a compiled backward is one graph and every bucket launches after it: no overlap."""
    old, old_first = TORCH_DDP._active_ddp_module, dist._DEFAULT_FIRST_BUCKET_BYTES
    TORCH_DDP._active_ddp_module, dist._DEFAULT_FIRST_BUCKET_BYTES = module, first_bucket_bytes
    try:
        yield
    finally:
        TORCH_DDP._active_ddp_module, dist._DEFAULT_FIRST_BUCKET_BYTES = old, old_first


OPTIMIZER_IMPORTS = ("torch._dynamo",)  # torch.optim's first optimizer's import: a forking process imports it once
TENSOR_IMPL = attrgetter("_cdata")  # the TensorImpl a Python tensor holds: torch.utils.swap_tensors exchanges them


def cuda_fork_poisoned() -> bool:
    """Whether CUDA is unusable here because a parent asked the driver before forking this process."""
    return bool(getattr(torch.cuda, "_is_in_bad_fork", lambda: False)())


def compile_throwaway(*backends: str) -> None:
    """Compile a throwaway function once per ``torch.compile`` backend, then reset Dynamo; inductor compiles in
    this process (``compile_threads=1``: no worker pool starts here)."""
    import torch._dynamo
    import torch._inductor.config

    x = torch.ones(2, requires_grad=True)
    with torch._inductor.config.patch(compile_threads=1):
        for backend in backends:
            torch.compile(lambda t: torch.tanh(t) * 2, backend=backend)(x).sum().backward()
    torch._dynamo.reset()


def dynamo_skip_dirs() -> list[str] | None:
    """Dynamo's list of skipped source directories, or None before ``torch._dynamo`` was imported. Entries added
    here make Dynamo run those files eagerly, as it runs torch's own DDP wrapper; without it Dynamo traces the
    wrapper, and its counters become guards that recompile at every switch between ``no_sync`` and synced ones."""
    rules = sys.modules.get("torch._dynamo.trace_rules")
    return None if rules is None else rules.SKIP_DIRS


def skip_dir_of(module_name: str) -> str | None:
    """The directory (or file) Dynamo's ``trace_rules.add`` would skip for ``module_name``."""
    from importlib.util import find_spec
    spec = find_spec(module_name)
    if spec is None or spec.origin is None:
        return None
    origin = spec.origin
    return origin[: -len("__init__.py")] if origin.endswith("__init__.py") else origin


def recompile_skip_rules() -> None:
    """Dynamo caches a regex of SKIP_DIRS: rebuild it after a change."""
    sys.modules["torch._dynamo.trace_rules"]._recompile_re()


def dynamo_frame_callback_set() -> bool:
    """True inside ``torch.compile``'s tracing or a compiled callable (Dynamo's frame callback is set)."""
    ef = getattr(sys.modules.get("torch._C._dynamo"), "eval_frame", None)
    return ef is not None and ef.get_eval_frame_callback() not in (None, False)


def torch_function_stack() -> list[Any]:
    """The torch-function modes now active, innermost last (torch >= 2.2)."""
    return [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]


def push_torch_function_mode(mode: Any) -> None:
    """Push ``mode`` on this thread's torch-function stack without a ``with`` (``pop_torch_function_mode`` pops it)."""
    torch._C._push_on_torch_function_stack(mode)


def pop_torch_function_mode(mode: Any) -> bool:
    """Pop ``mode`` if it is the innermost torch-function mode; return whether it was."""
    n = torch._C._len_torch_function_stack()
    if n and torch._C._get_function_stack_at(n - 1) is mode:
        torch._C._pop_torch_function_stack()
        return True
    return False


def torch_function_disabled() -> bool:
    """True under ``torch._C.DisableTorchFunction`` (modes do not run)."""
    return torch._C._is_torch_function_all_disabled()


def module_slot_dicts(module: torch.nn.Module) -> tuple[dict, dict, dict]:
    """A module's own ``_parameters``, ``_buffers`` and ``_modules`` dicts: one walk of the tree finds both
    tensors, where ``parameters()`` and ``buffers()`` walk it twice, and their values tell a changed tree."""
    return module._parameters, module._buffers, module._modules


def caller_frame() -> Any:
    """The frame that called the function calling this (CPython's ``sys._getframe``)."""
    return sys._getframe(2)


def functional_call_code() -> Any:
    """The code object of ``torch.func.functional_call``'s worker, to find it on the stack (it swaps parameters
    for one call; without this the swap looks like a replaced parameter and raises)."""
    from torch.nn.utils import stateless
    return stateless._functional_call.__code__


def set_authoritative_rank(ddp: Any, rank: int) -> None:
    """torch's DDP names the rank a join copies the model from ``_authoritative_rank`` (torch's join
    tests read it); gradsync's wrapper keeps it under torch's name."""
    ddp._authoritative_rank = rank


def join_enabled(joinable: Any) -> bool:
    """Whether torch's ``Join`` context runs a join for ``joinable`` now (it sets ``_join_config``)."""
    return joinable._join_config.enable


def set_join_config_disabled(joinable: Any) -> None:
    """Leave torch's join mode for ``joinable`` (its ``_join_config``, which ``Join`` reads)."""
    joinable._join_config = disabled_join_config()


def disabled_join_config() -> Any:
    """torch's ``_JoinConfig`` for "no join in progress" (``Joinable`` reads ``_join_config``)."""
    from torch.distributed.algorithms.join import _JoinConfig
    return _JoinConfig.construct_disabled_join_config()


def device_index(device: Any) -> int:
    """torch's parsing of a ``device_ids`` entry (int, str or device) into an index."""
    from torch._utils import _get_device_index
    return _get_device_index(device, True)


def foreach_mul_(tensors: list[torch.Tensor], factor: Any) -> None:
    """Multiply ``tensors`` in place in one kernel launch per device and dtype."""
    torch._foreach_mul_(tensors, factor)


def foreach_copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[k].copy_(src[k])`` for every k in one call (a bucket's write-back), not a Python call per parameter."""
    torch._foreach_copy_(dst, src)


def foreach_zero_(tensors: list[torch.Tensor]) -> None:
    """``t.zero_()`` for every tensor in one call (none: nothing)."""
    if tensors:
        torch._foreach_zero_(tensors)


def foreach_div_(tensors: list[torch.Tensor], divisor: int) -> None:
    """``t.div_(divisor)`` for every tensor in one call (a bucket's small gradient slots), not one by one."""
    torch._foreach_div_(tensors, divisor)


def unscale_grads_(scaler: Any, *args: Any) -> dict[torch.device, torch.Tensor]:
    """torch's ``GradScaler._unscale_grads_``: the sharded scaler (``sharded/amp.py``) leaves other optimizers to it."""
    return torch.amp.GradScaler._unscale_grads_(scaler, *args)


def claim_amp_scaling(optimizer: torch.optim.Optimizer, claim: bool | None = True) -> bool | None:
    """Set ``optimizer``'s own ``_step_supports_amp_scaling`` (None: remove it) and return what it held. True: torch's
    GradScaler calls ``step()`` every time with ``found_inf``/``grad_scale`` set (its contract for fused optimizers)."""
    held = optimizer.__dict__.pop("_step_supports_amp_scaling", None)
    optimizer.__dict__.update(_step_supports_amp_scaling=claim) if claim is not None else None
    return held


def storage_base(t: torch.Tensor) -> torch.Tensor:
    """The tensor ``t`` is a view of, or ``t`` itself (to return a whole buffer to a pool)."""
    return t._base if t._base is not None else t


def stamp(t: torch.Tensor) -> tuple[Any, int]:
    """A mark of ``t``: ``unchanged(mark, x)`` says ``x`` is ``t``, unmodified since (a ``.grad`` we wrote, not the user's)."""
    return weakref.ref(t), t._version


def unchanged(mark: tuple[Any, int] | None, t: torch.Tensor | None) -> bool:
    return mark is not None and t is not None and mark[0]() is t and t._version == mark[1]


def saved_mean_reduction(grad_fn: Any, numel: int) -> bool:
    """True when ``grad_fn`` is a mean over more than ``numel`` elements, or a loss with ``reduction='mean'``
    (at::Reduction 1). Only warns: a False costs a missed warning."""
    if type(grad_fn).__name__ in ("MeanBackward0", "MeanBackward1"):  # None: NoneType, and no _saved_reduction
        return getattr(grad_fn, "_saved_self_sym_numel", 0) > numel
    return getattr(grad_fn, "_saved_reduction", None) == 1


__all__ = ["active_ddp_module", "BatchNormBase", "caller_frame", "claim_amp_scaling", "compile_throwaway", "ddp_markings", "default_first_bucket_bytes", "default_store", "detach_default_group", "device_index", "disabled_join_config", "dynamo_frame_callback_set", "dynamo_skip_dirs", "foreach_copy_",
           "foreach_div_", "foreach_mul_", "foreach_zero_", "functional_call_code", "Future", "graph_task_id", "group_timeout", "has_cpu_backend", "in_compiled_autograd", "is_future", "join_enabled", "module_slot_dicts", "OPTIMIZER_IMPORTS", "pop_torch_function_mode", "post_accumulate_hooks",
           "push_torch_function_mode", "queue_end_of_backward", "recompile_forward", "recompile_skip_rules", "saved_mean_reduction", "set_authoritative_rank", "set_join_config_disabled", "skip_dir_of", "storage_base", "TENSOR_IMPL", "to_kwargs", "torch_function_disabled", "torch_function_stack",
           "TorchDDP", "unscale_grads_"]


def to_kwargs(inputs: tuple, kwargs: dict, device: torch.device) -> tuple[tuple, dict]:
    """Move a forward's inputs to ``device`` as torch's single-device DDP does (streams included)."""
    from torch.distributed.utils import _to_kwargs
    moved, moved_kwargs = _to_kwargs(inputs, kwargs, device, True)
    return moved[0], moved_kwargs[0]


BatchNormBase = torch.nn.modules.batchnorm._BatchNorm  # BatchNorm*d's and SyncBatchNorm's: Chunked refuses them


def is_registered(group: dist.ProcessGroup) -> bool:  # one of torch's live groups (not destroyed or detached)
    return group in dist.distributed_c10d._world.pg_map


def abort_group(group: Any) -> None:
    """Abort ``group``'s communicators (NCCL: ``ncclCommAbort``): a kernel waiting on a dead peer frees its stream."""
    abort = getattr(group, "abort", None)
    if callable(abort):
        try:
            abort()
        except RuntimeError:
            pass


def recompile_forward(module: Any) -> None:
    """Drop Dynamo's graphs of ``module``'s forward (compiled before wrapping or not): its next call compiles again."""
    if (dynamo := sys.modules.get("torch._dynamo")) is not None:
        dynamo.reset_code(type(getattr(module, "_orig_mod", module)).forward.__code__)


def default_store() -> Any:  # the default group's store: a replacement group can rendezvous on it
    return dist.distributed_c10d._get_default_store()


def detach_default_group() -> Any:
    """Unregister torch's default group without shutting it down (``elastic/membership.py``); return it (or None).
    Shutting it down joins its threads, and one waiting on a member that stopped sending blocks until gloo's
    timeout. The caller keeps the group referenced: its destructor must not run."""
    if not dist.is_initialized():
        return None
    c10d = dist.distributed_c10d
    pg = c10d._get_default_group()
    c10d._update_default_pg(None)
    world = c10d._world
    for table in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config,
                  world.pg_to_tag, world.pg_coalesce_state):
        table.pop(pg, None)
    for groups in world.tags_to_pg.values():
        if pg in groups:
            groups.remove(pg)
    c10d._unregister_process_group(pg.group_name)
    world.group_count = 0  # the next default group gets the name a fresh process would give it
    return pg
