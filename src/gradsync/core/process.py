"""Every process-wide effect gradsync has, in one registry: each installed once, idempotent, reversible.

An effect changes something outside the objects a user created (a torch list, a global hook).
Each one is an ``Effect`` registered here under a name, with the reason it exists; ``installed()``
lists those in force and ``uninstall_all()`` puts torch back as it was (tests/core/test_process.py
checks both). ``docs/differences.md`` lists them for users.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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


__all__ = ["Effect", "install", "installed", "skip_in_dynamo", "uninstall", "uninstall_all"]
