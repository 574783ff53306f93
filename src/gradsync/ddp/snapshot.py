"""The parameters a wrapper saw at construction, checked before each forward.

The buckets are laid out for exactly these parameters, dtypes and devices: a parameter added,
replaced or converted (``model.double()``, ``.to()``) after wrapping must fail loudly at the next
forward, while ``torch.func.functional_call`` may substitute them for the length of one call.
"""
from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch
from torch import nn

from .._torch import TENSOR_IMPL, caller_frame, functional_call_code, module_slot_dicts


@dataclass
class Snapshot:
    """The parameters a wrapper saw at construction, by column; and the module tree at the latest walk."""

    params: list[torch.Tensor]
    requires_grad: list[bool]
    dtypes: list[torch.dtype]
    devices: list[torch.device]
    impls: list[int]  # TENSOR_IMPL: the hooks live on these; a swap (swap_module_params_on_conversion) leaves them
    slots: tuple | None = None  # the walk's modules' own slot dicts, their lengths, those that held values, the values
    tensors: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # what that walk found
    may_freeze: bool = False  # a parameter the reducer holds (its hook, its slot) may be frozen and unfrozen later

    def __setstate__(self, state: dict) -> None:  # a pickled or deep-copied wrapper: new tensors, new TensorImpls
        self.__dict__.update(state)
        self.impls = list(map(TENSOR_IMPL, self.params))


def snapshot(module: nn.Module, may_freeze: bool = False) -> Snapshot:
    """``may_freeze``: a parameter that required gradients at construction may be frozen and unfrozen later (its
    hook then does not fire, and the synced backward leaves its ``.grad`` alone, as for an unused parameter)."""
    params = list(module.parameters())
    return Snapshot(params, [p.requires_grad for p in params], [p.dtype for p in params], [p.device for p in params],
                    list(map(TENSOR_IMPL, params)), may_freeze=may_freeze)


_WALKS = ("parameters", "named_parameters", "buffers", "named_buffers", "_named_members", "named_modules")


def module_tensors(module: nn.Module, snap: Snapshot | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``list(module.parameters())`` and ``list(module.buffers())``, the same tensors in the same order,
    in one walk over the module tree without building names (the wrapper runs it before each forward:
    on a model of hundreds of modules the two torch walks cost milliseconds). With ``snap``, the walk is
    kept and runs again only once a module's own slots changed (checked by identity, a fraction of a
    walk). A module tree whose classes override one of torch's walks is walked by torch's own methods."""
    if snap is not None and snap.slots is not None and same_slots(*snap.slots):
        return snap.tensors  # type: ignore[return-value]
    if any(getattr(type(module), name) is not getattr(nn.Module, name) for name in _WALKS):
        return list(module.parameters()), list(module.buffers())
    params: list[torch.Tensor] = []
    buffers: list[torch.Tensor] = []
    seen_params: set[int] = set()
    seen_buffers: set[int] = set()
    seen_modules: set[nn.Module] = set()  # as torch's named_modules memo: each module once, pre-order
    dicts: list[dict] = []
    stack = [module]
    named_modules = nn.Module.named_modules
    while stack:
        m = stack.pop()
        if m in seen_modules:
            continue
        if type(m).named_modules is not named_modules:
            return list(module.parameters()), list(module.buffers())
        seen_modules.add(m)
        own = module_slot_dicts(m)
        if not all(isinstance(d, dict) for d in own):  # a ScriptModule's slots are torch's own wrappers
            return list(module.parameters()), list(module.buffers())
        dicts.extend(own)
        own_params, own_buffers, children = (d.values() for d in own)
        for p in own_params:
            if p is not None and id(p) not in seen_params:
                seen_params.add(id(p))
                params.append(p)
        for b in own_buffers:
            if b is not None and id(b) not in seen_buffers:
                seen_buffers.add(id(b))
                buffers.append(b)
        stack.extend([c for c in reversed(children) if c is not None])
    if snap is not None:
        filled = [d for d in dicts if d]
        snap.slots = (dicts, list(map(len, dicts)), filled, list(chain.from_iterable(map(dict.values, filled))))
        snap.tensors = (params, buffers)
        return snap.tensors
    return params, buffers


def same_slots(dicts: list[dict], lengths: list[int], filled: list[dict], values: list) -> bool:
    """Whether no slot dict gained, lost or replaced a value since the walk, in C loops: the same lengths, and the
    same objects in the dicts that held any (a dict empty then shows any new value in its length)."""
    return list(map(len, dicts)) == lengths and all(map(operator.is_, chain.from_iterable(map(dict.values, filled)), values))


def parameters_swapped(module: nn.Module, taken: Snapshot, own: Sequence[torch.Tensor],
                       current: list[torch.Tensor] | None = None) -> bool:
    """Return True while ``torch.func.functional_call`` substitutes all of ``own`` (then the
    forward is local); raise if the parameters changed for good. ``current``: the module's
    parameters, when the caller already listed them (``module_tensors``)."""
    if current is None:
        current = list(module.parameters())
    if (len(current) == len(taken.params) and all(map(operator.is_, current, taken.params))
            and [p.requires_grad for p in current] == taken.requires_grad
            and [p.dtype for p in current] == taken.dtypes and [p.device for p in current] == taken.devices
            and list(map(TENSOR_IMPL, current)) == taken.impls):
        return False
    if inside_functional_call():
        # like torch: gradients of the substituted tensors stay local; if some of gradsync's
        # parameters are still in use, the backward synchronizes them as usual
        mine = {id(p) for p in own}
        return not any(id(p) in mine for p in current)
    if len(current) == len(taken.params) and not all(map(operator.is_, current, taken.params)):
        _reorder(taken, current)  # prune and spectral_norm rename a parameter: the same object, later in the order
    if len(current) == len(taken.params) and _raise_converted(module, taken, own):
        return False  # layers frozen or unfrozen, or reordered: the hooks and buckets still fit
    raise RuntimeError(
        "gradsync: the module's parameters changed after it was wrapped (a parameter was added, "
        "removed or replaced, or its requires_grad changed). gradsync only synchronizes the "
        "parameters it saw at construction; make such changes before wrapping, then wrap again."
    )


def _reorder(taken: Snapshot, current: list[torch.Tensor]) -> None:
    """Put ``taken``'s columns in ``current``'s order when ``current`` holds the same parameter objects."""
    where = {id(p): k for k, p in enumerate(taken.params)}
    order = [where.get(id(p)) for p in current]
    if None in order or len(set(order)) != len(order):
        return
    for column in ("params", "requires_grad", "dtypes", "devices", "impls"):
        setattr(taken, column, [getattr(taken, column)[k] for k in order])


def _raise_converted(module: nn.Module, taken: Snapshot, own: Sequence[torch.Tensor]) -> bool:
    """Raise if a parameter changed dtype or device (module.double() and .to() keep the Parameter objects,
    except to or from meta, and swap their data) or requires_grad (a layer frozen or unfrozen) where that is not
    allowed; return whether the parameters are the same objects (then only allowed freezes changed, now taken)."""
    held, kept = {id(p) for p in own} if taken.may_freeze else set(), True  # the reducer's: a hook and a slot each
    for k, ((name, p), dtype, device, was, same, impl) in enumerate(zip(
            module.named_parameters(), taken.dtypes, taken.devices, taken.requires_grad, taken.params, taken.impls)):
        if p.dtype is not dtype or p.device != device:
            raise RuntimeError(
                f"gradsync: parameter {name!r} changed from {dtype} on {device} to {p.dtype} on "
                f"{p.device} after the module was wrapped (model.double(), .half(), .to(...)). The "
                "gradient buckets keep the dtype and device the parameters had at construction; call "
                "module.to(...) before wrapping it in DistributedDataParallel, or wrap it again.")
        if p is same and TENSOR_IMPL(p) != impl:
            raise RuntimeError(
                f"gradsync: parameter {name!r} had its tensor swapped after the module was wrapped (torch.utils."
                "swap_tensors, as module.to(...) does under torch.__future__.set_swap_module_params_on_conversion(True)): "
                "gradsync's gradient hooks stayed on the old tensor, so no gradient would be synchronized (torch's DDP "
                "refuses such a conversion). Convert the module before wrapping it, or wrap it again.")
        if p is same and p.requires_grad != was and id(p) in held:  # frozen or unfrozen: its hook and slot stay
            taken.requires_grad[k] = p.requires_grad
        elif p is same and p.requires_grad != was:
            raise RuntimeError(
                f"gradsync: parameter {name!r} was {'frozen' if was else 'unfrozen'} (requires_grad set to "
                f"{p.requires_grad}) after the module was wrapped; the gradient buckets and hooks cover the parameters "
                "that required gradients at construction. To freeze or unfreeze layers during training, wrap the "
                "module again after the change (model = gradsync.DistributedDataParallel(module, ...)): the new "
                "wrapper takes the parameters over, and the optimizer keeps working on the same parameters.")
        kept = kept and p is same
    return kept


def inside_functional_call() -> bool:
    """True when called (indirectly) from ``torch.func.functional_call``, which swaps parameters
    for the duration of one call."""
    code = _functional_call_code()
    frame = caller_frame()
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _functional_call_code():
    return functional_call_code()
