"""Every process-wide effect and piece of state gradsync has, in one module.

Effects: each installed once, idempotent, reversible.

An effect changes something outside the objects a user created (a torch list, a global hook).
Each one is an ``Effect`` registered here under a name, with the reason it exists; ``installed()``
lists those in force and ``uninstall_all()`` puts torch back as it was (tests/test_process.py
checks both). ``docs/differences.md`` lists them for users.
"""
from __future__ import annotations

import atexit
import functools
import inspect
import importlib.abc
import importlib.util
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.utils.clip_grad

from . import _torch


@dataclass(kw_only=True)
class Effect:
    """One process-wide change: ``apply()`` makes it, ``undo()`` reverts it; both run at most once."""

    name: str
    reason: str
    apply: Callable[[], Any]
    undo: Callable[[], None]
    active: bool = field(default=False, init=False)


_effects: dict[str, Effect] = {}


def install(effect: Effect) -> Effect:
    """Apply ``effect`` unless one of that name is in force; return the one in force."""
    current = _effects.get(effect.name)
    if current is not None and current.active:
        return current
    effect.apply()
    effect.active = True
    _effects[effect.name] = effect
    return effect


def uninstall(name: str) -> None:
    """Revert the effect called ``name`` (nothing if it is not in force)."""
    effect = _effects.pop(name, None)
    if effect is not None and effect.active:
        effect.undo()
        effect.active = False


def installed() -> list[str]:
    """The names of the effects in force."""
    return sorted(n for n, e in _effects.items() if e.active)


def uninstall_all() -> None:
    for name in list(_effects):
        uninstall(name)


# ---------------------------------------------------------------- process-wide state
@dataclass
class State:
    """Everything gradsync keeps per process, not per object; each field says who uses it and why.

    The modules change these fields; none of them rebinds a module-level name of its own."""

    # engine/control.py: the collective waited last stays referenced here until the next wait, so that
    # its last reference is Python's, never gloo's thread's during interpreter shutdown (see exit-hook)
    last_wait: Any = None
    exit_hook: bool = False  # install_exit_hook() ran
    # engine/groups.py: control groups by ranks (the whole world or a subgroup), shared by every wrapper on them
    control_groups: dict = field(default_factory=dict)
    # ddp/guard.py: the optimizer-step guard's reducers and its cache of what each optimizer touches
    guard_known: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    guard_exclusive: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    guard_ids: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    guard_cache: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    guard_version: int = 0  # bumped when the known or exclusive reducers change: cached entries recompute
    guard_anyone: bool = False  # the guard was installed without a reducer: every closure is checked
    guard_handle: Any = None
    # ddp/compat.py: replace_torch_ddp() scopes in force, and the redirect's generation
    redirects: int = 0
    redirect_generation: int = 0
    # the commit protocol that models built on the default process group attach to (None: plain DDP);
    # a feature installs it (gradsync.elastic) and the wrapper attaches to it at construction
    protocol: Any = None
    # what features hear of the layers above the engine: "wrapper" (a model was built), "accumulator"
    # (one was built), "window" (an accumulator is between windows); see ``announce``
    listeners: dict = field(default_factory=dict)
    replica: Any = None  # gradsync.elastic: this process's replica in the job, once it joined
    # engine/launcher.py: hooks declared to issue one collective (value: the world sizes, None: any)
    one_collective_hooks: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)


state = State()


def listen(event: str, callback: Callable[..., None]) -> None:
    """Call ``callback(*args)`` whenever ``announce(event, *args)`` runs (once per callback)."""
    callbacks = state.listeners.setdefault(event, [])
    if callback not in callbacks:
        callbacks.append(callback)


def announce(event: str, *args: Any) -> None:
    """Tell the features listening (``listen``) that ``event`` happened; nothing when none listens."""
    for callback in state.listeners.get(event, ()):
        callback(*args)


def install_exit_hook() -> None:
    """At exit, release the GIL once (``State.last_wait``); installed with the first wait."""
    def apply() -> None:
        atexit.register(_release_gil_before_shutdown)
        state.exit_hook = True

    def undo() -> None:
        atexit.unregister(_release_gil_before_shutdown)
        state.exit_hook = False
    install(Effect(name="exit-hook", apply=apply, undo=undo,
                   reason="a collective's last reference dropped by gloo's thread during interpreter "
                          "shutdown aborts the process; at exit the GIL is released once so it is not"))


def _release_gil_before_shutdown() -> None:
    # gloo's thread may still wait for the GIL to drop a hook's callback: let it, while the
    # interpreter is whole ("terminate called without an active exception" otherwise)
    if state.last_wait is not None:
        time.sleep(0.01)


# ---------------------------------------------------------------- Dynamo runs our wrappers eagerly
# Importing torch's compiler takes about 2 s, so constructing a wrapper must not do it: the skip
# rule is added when ``torch._dynamo`` is imported (by torch.compile, or an optimizer's first step),
# through an import hook that waits for Dynamo's trace rules module.
_pending_skips: dict[str, str] = {}  # module name -> skipped directory, waiting for Dynamo's import


class _AfterTraceRules(importlib.abc.MetaPathFinder):
    """Adds the pending skip rules right after ``torch._dynamo.trace_rules`` is executed."""

    target = "torch._dynamo.trace_rules"

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != self.target:
            return None
        sys.meta_path.remove(self)  # find the real spec without finding ourselves
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _ThenApply(spec.loader)
        return spec


class _ThenApply(importlib.abc.Loader):
    def __init__(self, loader: Any):
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        _apply_pending_skips()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


_finder = _AfterTraceRules()


def _apply_pending_skips() -> None:
    dirs = _torch.dynamo_skip_dirs()
    if dirs is None:
        return
    for directory in _pending_skips.values():
        if directory not in dirs:
            dirs.append(directory)
    _torch.recompile_skip_rules()
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)


def skip_in_dynamo(module_name: str) -> None:
    """Make Dynamo run ``module_name``'s files eagerly, now or once Dynamo is imported."""
    directory = _torch.skip_dir_of(module_name)
    if directory is None:
        return

    def apply() -> None:
        _pending_skips[module_name] = directory
        if _torch.dynamo_skip_dirs() is None:
            if _finder not in sys.meta_path:
                sys.meta_path.insert(0, _finder)
        else:
            _apply_pending_skips()

    def undo() -> None:
        _pending_skips.pop(module_name, None)
        dirs = _torch.dynamo_skip_dirs()
        if dirs is not None and directory in dirs:
            dirs.remove(directory)
            _torch.recompile_skip_rules()
        if not _pending_skips and _finder in sys.meta_path:
            sys.meta_path.remove(_finder)

    install(Effect(name=f"dynamo-skip:{module_name}", apply=apply, undo=undo,
                   reason="torch.compile runs the wrapper eagerly, as it runs torch's DDP: traced, its "
                          "counters and flags would become guards and recompile at every no_sync switch"))


# ---------------------------------------------------------------- torch.nn.utils.clip_grad_norm_, clip_grad_value_
# Users clip with torch's functions. Their answer is wrong for some gradsync models (a sharded model's
# .grad is None: they would clip nothing; after an overlapped step clipping is too late), so one patch
# asks every owner in turn. Explicit is preferred: model.clip_grad_norm_(max_norm).
class ClipOwner(Protocol):
    def clip_grad_norm_for(self, params: list[torch.Tensor], max_norm: float, norm_type: float,
                           error_if_nonfinite: bool, foreach: bool | None) -> torch.Tensor | None:
        """The total norm if these parameters are this owner's to clip (clipped), None if none are
        its own; raise to refuse (part of its parameters, or clipping makes no sense now)."""

    def clip_grad_value_for(self, params: list[torch.Tensor], clip_value: float, foreach: bool | None) -> bool | None:
        """True if these parameters were this owner's to clip (clipped), None if none are its own; raise to refuse."""


_clip_owners: dict[int, weakref.ref] = {}  # id -> weak reference, in the order owners claimed
_CLIP = "clip_grad_norm_"
_CLIP_NAMES = tuple((module, name) for name in ("clip_grad_norm_", "clip_grad_value_")
                    for module in (torch.nn.utils, torch.nn.utils.clip_grad))


def claim_clip_grad_norm(owner: ClipOwner) -> None:
    """Ask ``owner`` first whenever ``torch.nn.utils.clip_grad_norm_`` or ``clip_grad_value_`` runs, while it lives."""
    key = id(owner)
    if key not in _clip_owners:
        _clip_owners[key] = weakref.ref(owner, lambda _, key=key: _drop_clip_owner(key))
    install(Effect(name=_CLIP, apply=_patch_clip, undo=_unpatch_clip,
                   reason="torch's functions read .grad: for a sharded model they would clip nothing, "
                          "after an overlapped optimizer step they would clip too late"))


def release_clip_grad_norm(owner: ClipOwner) -> None:
    """Stop asking ``owner``; the patch goes with the last owner."""
    ref = _clip_owners.get(id(owner))
    if ref is not None and ref() is owner:
        _drop_clip_owner(id(owner))


def _drop_clip_owner(key: int) -> None:
    _clip_owners.pop(key, None)
    if not _clip_owners:
        uninstall(_CLIP)


_clip_saved: list[tuple[Any, str, Any, Any]] = []  # (module, name, what it held, our replacement)


def _patch_clip() -> None:
    made: dict[int, Any] = {}  # one replacement per original: both modules usually hold the same function
    for module, name in _CLIP_NAMES:
        original = getattr(module, name)
        if id(original) not in made:
            made[id(original)] = _asking_owners(original, f"{name.rstrip('_')}_for")
        _clip_saved.append((module, name, original, made[id(original)]))
        setattr(module, name, made[id(original)])


def _unpatch_clip() -> None:
    while _clip_saved:
        module, name, original, ours = _clip_saved.pop()
        if getattr(module, name) is ours:  # someone who patched on top of us keeps theirs (ours passes through)
            setattr(module, name, original)


def _asking_owners(original: Callable[..., Any], ask: str) -> Callable[..., Any]:
    signature = inspect.signature(original)  # owners get every argument, positionally, defaults filled in

    @functools.wraps(original)
    def clip(*args: Any, **kwargs: Any) -> Any:
        owners = [o for o in (ref() for ref in list(_clip_owners.values())) if o is not None]
        if not owners:
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        parameters, *rest = bound.arguments.values()
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        for owner in owners:
            done = getattr(owner, ask)(parameters, *rest)
            if done is not None:  # the norm, or True for clip_grad_value_ (which returns None, as torch's)
                return None if done is True else done
        return original(parameters, *rest)
    return clip


__all__ = ["ClipOwner", "Effect", "State", "announce", "install_exit_hook", "listen", "state", "claim_clip_grad_norm", "install", "installed", "release_clip_grad_norm",
           "skip_in_dynamo", "uninstall", "uninstall_all"]
