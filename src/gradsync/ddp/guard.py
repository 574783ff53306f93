"""Refuse an optimizer step on gradients that local backwards left unsynchronized.

A reducer whose backward ran without synchronizing (``no_sync``, or a backward without the
wrapper's forward) sets its ``unsynced`` flag; the end of its next synced backward clears it. One
global optimizer-step pre-hook (torch calls it for every optimizer) asks the marked reducers
whether the optimizer's parameters hold such gradients and raises before anything changes.
With no reducer marked, which is every step of a correct loop, the hook only tests two sets.
A step with a closure is checked after the closure (whose backward may be the synced one), but
only for an optimizer that steps parameters of a reducer known here: others pay nothing.
Reducers whose parameters only their own optimizer may step (sharded gradients: ``.grad`` is
None after a synced backward, so a plain optimizer would silently do nothing) register as
exclusive and are asked about every step that touches their parameters.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .. import process
from .._torch import graph_task_id

state = process.state  # the guard's reducers and caches are process-wide (process.State.guard_*)


def install(reducer: Any = None) -> None:
    """Register the global optimizer-step pre-hook (once per process) and, if given, ``reducer``:
    the closures of the optimizers that step its parameters are checked after they run."""
    if reducer is None:
        state.guard_anyone = True
    else:
        _know(reducer)
    if state.guard_handle is None:
        process.install(process.Effect(
            name="optimizer-step-guard", apply=_register, undo=_unregister,
            reason="an optimizer step on gradsync parameters whose gradients were not synchronized "
                   "would let the replicas drift apart silently; it raises before anything changes"))


def _register() -> None:
    state.guard_handle = register_optimizer_step_pre_hook(_check_step)


def _unregister() -> None:
    state.guard_handle.remove()
    state.guard_handle = None


def _know(reducer: Any) -> None:
    if reducer not in state.guard_known:
        state.guard_known.add(reducer)
        state.guard_version += 1


def watch(reducer: Any) -> None:
    """Guard the steps on ``reducer``'s parameters: once it has more than one rank, steps on gradients
    it left unsynced (``reducer.unsynced``) raise; a store whose parameters only its own optimizer may
    step (``exclusive``) is asked about every step that touches them."""
    if reducer.store.exclusive:
        state.guard_exclusive.add(reducer)
        state.guard_version += 1
        install(reducer)
    if reducer.world_size > 1:
        install(reducer)  # now, not at the first local backward: a step's closure may run that


def release(reducer: Any) -> None:
    """The wrapper is gone or superseded: no hooks left behind, its parameters train locally."""
    reducer.remove_hooks()
    forget(reducer)


def forget(reducer: Any) -> None:
    """The wrapper is gone: its parameters train locally from now on."""
    reducer.unsynced = False
    if reducer in state.guard_known or reducer in state.guard_exclusive:
        state.guard_known.discard(reducer)
        state.guard_exclusive.discard(reducer)
        state.guard_version += 1


def _ids_of(reducer: Any) -> frozenset:
    ids = state.guard_ids.get(reducer)
    if ids is None:
        ids = state.guard_ids[reducer] = frozenset(id(p) for p in reducer.params)
    return ids


def alive(reducers: weakref.WeakSet) -> list:
    """The set's live members, its references copied in one C call: a wrapper's finalizer (``forget``), run by a
    collection during a Python-level walk of the set, would change it under the walk ("Set changed size")."""
    return [r for r in (ref() for ref in tuple(reducers.data)) if r is not None]


def _entry(optimizer: torch.optim.Optimizer) -> list:
    """[signature, parameter ids, version, exclusive reducers touched, touched by a known reducer], cached."""
    groups = optimizer.param_groups
    # the lists themselves, held: an id alone matches a new list CPython puts where a freed one was
    signature = [(g["params"], len(g["params"])) for g in groups]
    try:
        entry = state.guard_cache.get(optimizer)
    except TypeError:  # not weak-referenceable: no cache
        entry = None
    if entry is None or len(entry[0]) != len(signature) or not all(
            a is b and m == n for (a, m), (b, n) in zip(entry[0], signature)):
        entry = [signature, frozenset(id(p) for g in groups for p in g["params"]), -1, (), False]
        try:
            state.guard_cache[optimizer] = entry
        except TypeError:
            pass
    if entry[2] != state.guard_version:
        entry[3] = tuple(weakref.ref(r) for r in alive(state.guard_exclusive) if not _ids_of(r).isdisjoint(entry[1]))
        entry[4] = any(not _ids_of(r).isdisjoint(entry[1]) for r in alive(state.guard_known))
        entry[2] = state.guard_version
    return entry


def _check_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Any:
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args[0] is the optimizer
    if not callable(closure):
        _check(optimizer)
        return None
    if not state.guard_anyone and not (state.guard_known and _entry(optimizer)[4]):
        return None  # no gradsync model touches this optimizer: its closure reaches it untouched

    # The closure's backward may be the window's synced one (Lightning steps that way): check
    # after it, still before the optimizer updates anything.
    def checked(*a: Any, **k: Any) -> Any:
        loss = closure(*a, **k)
        _check(optimizer)
        return loss
    if "closure" in kwargs:
        return args, {**kwargs, "closure": checked}
    return (args[0], checked, *args[2:]), kwargs


def _check(optimizer: torch.optim.Optimizer) -> None:
    known = alive(state.guard_known)
    unsynced = [r for r in known if r.unsynced]
    # a step from a gradient hook (an optimizer stepped in backward), in a backward of the model or right before it
    # (a hook on its first gradient runs before the model's own); overlap_optimizer's come once a bucket is reduced
    inside = [r for r in known if r.it.in_backward or r.counters.pending] if graph_task_id() != -1 else []
    if not (unsynced or inside or state.guard_exclusive):
        return
    _, ids, _, touched, _ = _entry(optimizer)
    for reducer in inside:
        it = reducer.it
        if it.syncing and all(it.ready):
            continue
        ready = it.ready if it.syncing else [False] * len(reducer.params)
        early = [n for n, p, r in zip(reducer.names, reducer.params, ready) if not r and id(p) in ids and p.grad is not None]
        if early:
            raise RuntimeError(
                f"gradsync: {type(optimizer).__name__}.step() ran inside a backward of the {reducer.config.wrapper_name} "
                f"model (from a gradient hook: an optimizer stepped in backward) on {len(early)} parameter(s) whose "
                f"gradients are not reduced across ranks yet ({', '.join(early[:5])}{', ...' if len(early) > 5 else ''}): "
                "every rank would step with its own gradient and the replicas would drift apart. Step after backward() "
                "returns, or use gradsync.overlap_optimizer(model, optimizer), which steps each bucket inside the synced "
                "backward as soon as it is reduced.")
    for ref in touched:
        reducer = ref()
        if reducer is not None:
            reducer.store.check_foreign_step(optimizer)
    for reducer in unsynced:
        pending = [i for i, used in enumerate(reducer.window_used) if used and reducer.store.has_local_grad(i)]
        if not pending:  # zero_grad() dropped them
            reducer.unsynced = False
            continue
        names = [reducer.names[i] for i in pending if id(reducer.params[i]) in ids]
        if names:
            shown = ", ".join(f"'{n}'" for n in names[:5]) + (", ..." if len(names) > 5 else "")
            raise RuntimeError(
                f"gradsync: {type(optimizer).__name__}.step() would apply unsynchronized gradients: "
                f"{len(names)} parameter(s) of the {reducer.config.wrapper_name} model ({shown}) hold "
                "gradients from backward(s) under no_sync() (or without a forward through the "
                "wrapper, or a synced backward that raised) that were not reduced across ranks yet, so every rank would step with its "
                "own gradients and the replicas would drift apart. Run the accumulation window's last "
                "backward with gradient sync enabled before optimizer.step(), or wrap the optimizer "
                "with GradientAccumulator.wrap_optimizer() so that it steps only where a window ends "
                "(or call optimizer.zero_grad() to discard those gradients).")


__all__ = ["forget", "install", "release", "watch"]
