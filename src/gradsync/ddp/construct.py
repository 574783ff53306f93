"""What ``DistributedDataParallel`` checks before it builds a reducer.

The check that every rank wraps the same model, the initial broadcast in bounded chunks, the registry
of parameters owned by live wrappers, and the communication hook's signature check. Constructor
options are resolved in ``options.py``.
"""
from __future__ import annotations

import hashlib
import inspect
import re
import sys
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._torch import ddp_markings
from ..engine.layout import MiB
from ..engine.launcher import GradBucket
from ..engine.errors import SyncError
from ..engine.control import bounded_wait

# The initial broadcast copies at most this much into one flat tensor at a time (torch: 250 MiB)
BROADCAST_CHUNK_BYTES = 25 * MiB

# id(parameter) -> the live wrapper that owns it; an entry goes when its wrapper is collected
_OWNER: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def initial_wait(handle: Any, timeout: timedelta, rank: int) -> None:
    """Wait for a collective of the initial broadcast, bounded by ``timeout``."""
    try:
        bounded_wait(handle, timeout)
    except Exception as exc:
        raise SyncError(
            f"gradsync: rank {rank} waited for the initial broadcast of parameters and buffers and it failed "
            f"or did not finish within {timeout.total_seconds():g}s: {exc}. Likely cause: another rank died "
            "or raised while wrapping its model, or wraps a different number of models.") from exc


def check_group(group: dist.ProcessGroup) -> None:
    """Raise if the model's process group is gone."""
    try:
        ok = dist.is_initialized() and dist.get_rank(group) >= 0
    except (ValueError, RuntimeError):
        ok = False
    if not ok:
        raise RuntimeError(
            "gradsync: the model's process group was destroyed (or torch.distributed was shut down); "
            "DistributedDataParallel cannot communicate any more. Call model.module(...) for local "
            "inference, or init_process_group() again and wrap a new model.")


# Options that must agree across ranks: they lay out the buckets or shape the end-of-backward control, so ranks
# that differ would meet collectives of other sizes (gloo aborts the process) or wait for one never issued
AGREED = ("bucket_cap_mb", "first_bucket_cap_mb", "auto_bucket_cap", "find_unused_parameters",
          "skip_all_reduce_unused_params", "reduce_dtype", "sharded", "check_replicas", "deterministic")


def describe(module: nn.Module, options: Any) -> list[tuple]:
    """Return what must agree across ranks: (kind, name, shape, dtype, requires_grad, strides) per tensor, and
    ("option", name, value, "", False) per option of ``options.config`` in ``AGREED``, the delayed parameters
    (reduced after the backward, not in a bucket) and, where there are buffers, whether a forward broadcasts them."""
    rows = [("parameter", n, tuple(p.shape), str(p.dtype), p.requires_grad, slot_strides(p))
            for n, p in module.named_parameters()]
    rows += [("buffer", n, tuple(b.shape), str(b.dtype), False, ()) for n, b in module.named_buffers()]
    rows += [("option", name, repr(getattr(options.config, name)), "", False) for name in AGREED]
    rows.append(("option", "delay_all_reduce_named_params", repr(sorted(options.delayed)), "", False))
    if any(row[0] == "buffer" for row in rows):
        rows.append(("option", "broadcast_buffers", repr(options.forward_sync_buffers), "", False))
        rows.append(("option", "init_sync_buffers", repr(options.init_sync_buffers), "", False))  # the next broadcast
    return rows


def slot_strides(p: torch.Tensor) -> tuple[int, ...]:
    """A parameter's strides, those of its size-1 dimensions left out: its bucket slot lays the gradient out so, and
    ranks whose layouts differ would add unrelated elements together (a channels_last model on one rank)."""
    return tuple(s if n > 1 else 0 for s, n in zip(p.stride(), p.shape))


def verify_same_model(module: nn.Module, group: dist.ProcessGroup, options: Any,
                      device: torch.device | None = None) -> None:
    """Raise on every rank if any rank's parameters, buffers or bucket options differ from rank 0's."""
    mine, timeout = describe(module, options), options.config.timeout
    # compare digests with a bounded collective; gather the details only on a mismatch
    digest = int.from_bytes(hashlib.sha256(repr(mine).encode()).digest()[:7], "little")
    digests = torch.zeros(dist.get_world_size(group), dtype=torch.int64, device=device)
    digests[dist.get_rank(group)] = digest
    try:
        bounded_wait(dist.all_reduce(digests, group=group, async_op=True), timeout)
    except Exception as exc:
        raise SyncError(
            f"gradsync: rank {dist.get_rank(group)} waited for the other ranks to construct "
            f"DistributedDataParallel and they did not within {timeout.total_seconds():g}s: {exc}. "
            "Likely cause: another rank died, raised before wrapping its model, or wraps a "
            "different number of models."
        ) from exc
    if len(set(digests.tolist())) == 1:
        return
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    reference = everyone[0]
    problems = [f"rank {r}: {_first_difference(reference, rows)}"
                for r, rows in enumerate(everyone) if rows != reference]
    if problems:
        raise ValueError(
            "gradsync: the model differs across ranks (compared with rank 0): " + "; ".join(problems)
            + ". Build the same model on every rank before wrapping it."
        )


def _first_difference(reference: list[tuple], rows: list[tuple]) -> str:
    """The first way ``rows`` differs from rank 0's ``reference``: parameters, then buffers, then options, each apart."""
    for kind in ("parameter", "buffer", "option"):
        ref, mine = [r for r in reference if r[0] == kind], [r for r in rows if r[0] == kind]
        ref_names, my_names = [r[1] for r in ref], [r[1] for r in mine]
        if ref_names != my_names:
            only_0, only_here = [n for n in ref_names if n not in my_names], [n for n in my_names if n not in ref_names]
            if only_0 or only_here:
                return f"has {len(mine)} {kind}s where rank 0 has {len(ref)} (only on rank 0: {only_0[:5]}; only here: {only_here[:5]})"
            return f"has its {kind}s in another order than rank 0's"
        for a, b in zip(ref, mine):
            if a != b and kind == "option":
                return f"has {b[1]}={b[2]} (rank 0: {a[2]}): pass the same options on every rank"
            if a != b:
                diffs = [f"{f} {y} (rank 0: {x})" for f, x, y in zip(("shape", "dtype", "requires_grad", "strides"), a[2:], b[2:])
                         if x != y]
                return f"{kind} '{b[1]}' has " + ", ".join(diffs)
    return "a description that differs from rank 0's"


def broadcast_coalesced(tensors: list[torch.Tensor], group: dist.ProcessGroup, wait: Callable,
                        src_rank: int = 0, chunk_bytes: int = BROADCAST_CHUNK_BYTES, in_place: bool = True) -> None:
    """Overwrite ``tensors`` with group rank ``src_rank``'s values.

    Tensors of one device are packed as raw bytes into flat chunks of about ``chunk_bytes``, so
    the extra memory is one chunk, not a copy of everything, and a module's buffers of several
    dtypes (BatchNorm: float and int64) take one broadcast, one round trip per forward, instead
    of one per dtype. A tensor alone in its chunk is sent in place, unless ``in_place=False``
    (an elastic model: a member frozen in a group the others left can complete the broadcast late).
    Written through ``.data``, as torch's C++ broadcast writes: no version bump, so a backward through an
    earlier forward that saved a buffer (BatchNorm's running statistics) still runs.
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    src = dist.get_global_rank(group, src_rank)
    for same in by_device.values():
        for chunk in _chunks(same, chunk_bytes):
            if in_place and len(chunk) == 1 and chunk[0].is_contiguous():
                wait(dist.broadcast(chunk[0].data, src=src, group=group, async_op=True))
                continue
            flat = torch.cat([_bytes(t.data.contiguous().reshape(-1)) for t in chunk])  # a strided slice: copied
            wait(dist.broadcast(flat, src=src, group=group, async_op=True))
            offset = 0
            for t in chunk:
                part = flat[offset:offset + t.numel() * t.element_size()]
                offset += part.numel()
                if t.is_contiguous():  # write the bytes straight into the tensor's memory
                    _bytes(t.data.reshape(-1)).copy_(part)
                else:
                    t.data.copy_(part.clone().view(t.dtype).view(t.shape))


def _bytes(flat: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor's memory as uint8 (a view); a 0-element tensor has no storage to view."""
    return flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)


def _chunks(tensors: list[torch.Tensor], chunk_bytes: int):
    chunk: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if chunk and size + nbytes > chunk_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append(t)
        size += nbytes
    if chunk:
        yield chunk


def check_broadcast_buffers(module: nn.Module) -> None:
    """Refuse buffers the wrapper would broadcast but cannot: sparse ones."""
    for name, b in module.named_buffers():
        if b.layout != torch.strided:
            raise NotImplementedError(
                f"gradsync: buffer '{name}' is a {b.layout} tensor, which gradsync cannot broadcast. Pass "
                "broadcast_buffers=False (each rank then keeps its own buffers) or make it dense (.to_dense())")


def check_wrappable(module: nn.Module, wrapper_types: tuple[type, ...]) -> list[tuple[str, nn.Parameter]]:
    """Return the trainable (name, parameter) pairs, or raise if ``module`` cannot be wrapped."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("gradsync: torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group() before wrapping the model")
    if isinstance(module, wrapper_types):
        raise ValueError(f"gradsync: the module is already wrapped in {type(module).__module__}."
                         f"{type(module).__name__}; wrap the inner module once")
    named = list(module.named_parameters())
    for name, p in named:
        if isinstance(p, nn.parameter.UninitializedParameter):
            raise ValueError(f"gradsync: parameter '{name}' is lazy (uninitialized). Run one forward "
                             "pass on a sample batch to materialize it before wrapping the model")
        if _is_dtensor(p):
            raise NotImplementedError(
                f"gradsync: parameter '{name}' is a DTensor (tensor parallelism); gradsync reduces "
                "plain tensors only. Use torch's DistributedDataParallel for DDP + tensor parallel.")
        if p.layout != torch.strided:  # torch refuses them too ("No support for sparse tensors")
            raise NotImplementedError(f"gradsync: parameter '{name}' is a {p.layout} tensor; gradsync synchronizes "
                                      "dense parameters only. Make it dense (.to_dense()) or keep it out of the module")
        if p.is_meta:  # a meta buffer is harmless: broadcasting it does nothing, as in torch
            raise ValueError(f"gradsync: parameter '{name}' is on the meta device (it has no data). "
                             "Materialize the module before wrapping it: module.to_empty(device=...), "
                             "then initialize it or load a state dict")
    lazy = [name for name, b in module.named_buffers() if isinstance(b, nn.parameter.UninitializedBuffer)]
    if lazy:
        raise ValueError(f"gradsync: buffer '{lazy[0]}' is lazy (uninitialized). Run one forward pass on a sample "
                         "batch to materialize it before wrapping the model")
    for name, m in module.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad:
            what = f"nn.{type(m).__name__} '{name}'" if name else f"the wrapped nn.{type(m).__name__}"
            raise NotImplementedError(
                f"gradsync: {what} has sparse=True: gradsync reduces dense "
                "gradients only; construct it with sparse=False (same gradients, dense), or use "
                "torch's DistributedDataParallel, which reduces sparse gradients")
        if isinstance(m, nn.SyncBatchNorm) and named and all(p.device.type == "cpu" for _, p in named):
            raise ValueError("SyncBatchNorm layers only work with GPU modules (torch's sentence: gradsync: on CPU "
                             "use nn.BatchNorm*d, or convert to SyncBatchNorm only where the model runs on GPUs)")
    ignored, in_backward = ddp_markings(module)
    if ignored:
        raise NotImplementedError(
            f"gradsync: the module has parameters or buffers marked for torch's DDP to ignore ({sorted(ignored)[:5]}, "
            "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model); gradsync would synchronize them. "
            "Wrap only the part to synchronize, or use torch's DistributedDataParallel.")
    if in_backward:
        raise NotImplementedError(
            f"gradsync: parameters {in_backward[:5]} step their optimizer in their own backward "
            "(torch.distributed.optim._apply_optimizer_in_backward), before gradsync averages their gradients. Use a "
            "plain optimizer, or gradsync.overlap_optimizer(model, optimizer), which steps each bucket once averaged.")
    trainable = [(n, p) for n, p in named if p.requires_grad]
    if not trainable:
        raise RuntimeError("gradsync: the module has no parameters that require gradients; "
                         "there is nothing to synchronize")
    return trainable


def _is_dtensor(p: torch.Tensor) -> bool:
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return dtensor is not None and isinstance(p, dtensor)


def claim(params: Sequence[torch.Tensor], wrapper: Any) -> None:
    """Record ``wrapper`` as the owner of ``params`` for as long as it lives.

    A parameter has one live owner: a previous wrapper of any of them is superseded (its hooks
    removed, its forward refused), as when ``ddp = DDP(model)`` runs again in a loop.
    """
    previous = {id(o): o for o in (_OWNER.get(id(p)) for p in params) if o is not None and o is not wrapper}
    for old in previous.values():
        old.supersede()
    _OWNER.update((id(p), wrapper) for p in params)


_FUTURE_TYPES = (torch.futures.Future, torch.futures.Future[torch.Tensor])


def check_comm_hook(hook: Any) -> None:
    """Raise like torch's ``_check_comm_hook`` when ``hook`` cannot be a communication hook."""
    if not callable(hook):
        raise TypeError(f"gradsync: Communication hook must be callable. Got {type(hook).__name__}: a hook is "
                        "hook(state, bucket) -> torch.futures.Future[torch.Tensor].")
    try:
        sig = inspect.signature(hook, eval_str=True)
    except (NameError, SyntaxError, TypeError):  # unresolvable string annotations: compare their text
        sig = inspect.signature(hook)
    except ValueError:  # no signature (a builtin): nothing to check
        return
    try:
        sig.bind(None, None)
    except TypeError as exc:  # torch fails at registration too (a KeyError), not at the first backward
        raise TypeError(f"gradsync: Communication hook {getattr(hook, '__name__', hook)!r} cannot be called as "
                        f"hook(state, bucket): {exc}. A hook is hook(state, bucket) -> torch.futures.Future[torch.Tensor].") from None
    params = list(sig.parameters.values())
    bucket = sig.parameters.get("bucket") or (params[1] if len(params) > 1 else None)
    if bucket is not None and not _annotation_ok(bucket.annotation, (dist.GradBucket, GradBucket),
                                                 r"((\w+\.)*)GradBucket"):
        raise ValueError(
            f"Communication hook: bucket annotation should be dist.GradBucket, got {bucket.annotation!r} "
            f"(hook {getattr(hook, '__name__', hook)!r}). A hook is hook(state, bucket: dist.GradBucket) "
            "-> torch.futures.Future[torch.Tensor].")
    if not _annotation_ok(sig.return_annotation, _FUTURE_TYPES,
                          r"((\w+\.)*)Future(\[((\w+\.)*)Tensor\])?"):
        raise ValueError(
            "Communication hook: return annotation should be torch.futures.Future[torch.Tensor], got "
            f"{sig.return_annotation!r} (hook {getattr(hook, '__name__', hook)!r}). The hook must return "
            "a future whose value is the reduced bucket tensor.")


def _annotation_ok(annotation: Any, allowed: tuple, pattern: str) -> bool:
    if annotation is inspect.Parameter.empty:
        return True
    if isinstance(annotation, str):
        return re.fullmatch(pattern, annotation.replace(" ", "")) is not None
    return any(annotation == a for a in allowed)
