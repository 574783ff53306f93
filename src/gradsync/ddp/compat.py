"""Run code written for ``torch.nn.parallel.DistributedDataParallel`` on gradsync, unchanged.

``replace_torch_ddp()`` makes every construction of torch's DDP class build a gradsync wrapper
instead, however the caller reached the class::

    with gradsync.replace_torch_ddp():          # a context manager ...
        trainer.fit(model)                       # Lightning, Accelerate, torch's own tests

    handle = gradsync.replace_torch_ddp()       # ... or a plain call, undone later
    ...
    handle.undo()

How it works, and why this way:

* Frameworks bind the class in different ways: Accelerate looks up
  ``torch.nn.parallel.DistributedDataParallel`` when it builds the model, Lightning imports
  ``from torch.nn.parallel.distributed import DistributedDataParallel`` when its module loads
  and keeps that reference. Swapping module attributes would miss references taken earlier, so
  torch's class object itself is redirected: its ``__init__`` is replaced by one that, for an
  instance of exactly that class, re-classes the fresh (still uninitialized) object to
  ``gradsync.ddp.compat.DistributedDataParallel`` and runs gradsync's ``__init__`` on it.
  Nothing in the frameworks or in torch's module namespaces is touched; torch's class stays the
  same object. (``__init__`` rather than ``__new__``: CPython cannot fully undo an assigned
  ``__new__`` — after ``del cls.__new__`` the class keeps the Python-level slot and
  ``object.__new__`` then rejects the constructor's arguments.)
* ``isinstance(model, torch.nn.parallel.DistributedDataParallel)`` must hold wherever a
  framework checks it (Accelerate's ``no_sync``/``unwrap_model``, Lightning's strategy hooks).
  The compat class therefore derives from gradsync's wrapper *and* from torch's class, without
  running torch's ``__init__``. So that no torch method ever runs on gradsync state, a facade
  class sits right before torch's class in the MRO and re-binds every name torch's class (or its
  ``Joinable`` base) defines to what ``nn.Module``/``object`` provide, or hides it (torch-private
  helpers gradsync does not define, such as ``_register_fused_optim``: looking them up raises
  ``AttributeError`` as on a plain gradsync wrapper, with a message naming the torch-only API;
  those gradsync does define, ``_get_ddp_logging_data`` and ``_set_static_graph``, are its own).
  This covers attribute lookup on instances and ``super()`` calls from gradsync's own methods
  (``super().__init__()``, ``super().__setstate__()`` land in ``nn.Module``). A compat instance
  thus behaves exactly as ``gradsync.DistributedDataParallel``; only ``isinstance``/``issubclass``
  against torch's class (and ``Joinable``) change.
* Subclasses of torch's class (user code, ``DistributedDataParallelCPU``) are left alone.
* Activations nest (a counter); the last ``undo()`` puts torch's class back exactly as it was
  (its ``__dict__`` holds the very same objects again), and later constructions build
  torch's own DDP again. ``undo()`` is idempotent per handle. While active, the redirect is the
  process-wide effect ``replace-torch-ddp`` (process.py): ``uninstall_all()`` ends it and
  spends every handle.
* Processes started after activation by re-running a script (``torchrun``, Lightning's
  subprocess launcher) must activate it again in that script; forked children inherit it.
"""
from __future__ import annotations

import functools
import threading
from typing import Any

from torch.nn.parallel.distributed import DistributedDataParallel as _TorchDDP

from .. import process
from .wrapper import DistributedDataParallel as _GradsyncDDP

__all__ = ["replace_torch_ddp", "is_torch_ddp_replaced", "TorchDDPReplacement", "DistributedDataParallel"]

# Type machinery that belongs to each class itself and must not be re-bound.
_CLASS_MACHINERY = frozenset({
    "__abstractmethods__", "__annotations__", "__dict__", "__doc__", "__module__",
    "__qualname__", "__slots__", "__weakref__", "_abc_impl", "__parameters__", "__orig_bases__",
    "__init_subclass__", "__subclasshook__", "__class_getitem__", "__firstlineno__",
    "__static_attributes__", "__type_params__",
})


class _TorchOnly:
    """A name torch's DDP class defines and gradsync's wrapper does not: absent on instances.

    A non-data descriptor, so an instance attribute of the same name (set by gradsync) wins.
    """

    def __init__(self, name: str):
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self  # class-level access (and ABCMeta's abstract-method scan) sees a plain object
        raise AttributeError(self.name)

    def __repr__(self) -> str:
        return f"<torch-only DDP attribute {self.name!r}: not provided by gradsync>"


def _shared_lookup(name: str) -> Any:
    """What ``name`` resolves to in the classes gradsync's wrapper shares with torch's (nn.Module, object)."""
    for klass in _GradsyncDDP.__mro__:
        if klass in _TorchDDP.__mro__ and name in vars(klass):
            return vars(klass)[name]
    return _TorchOnly(name)


def _facade_namespace() -> dict[str, Any]:
    names: set[str] = set()
    for klass in _TorchDDP.__mro__:
        if klass not in _GradsyncDDP.__mro__:  # torch's DDP, Joinable, ABC
            names.update(vars(klass))
    namespace = {name: _shared_lookup(name) for name in sorted(names - _CLASS_MACHINERY)}
    namespace.update({"__module__": __name__, "__doc__": (
        "torch's DDP class with everything it defines hidden: placed right before it in the MRO, so "
        "neither attribute lookup nor ``super()`` from gradsync's methods ever reaches torch's code.")})
    return namespace


# Directly in front of torch's class in the compat MRO: every name torch's class (and Joinable)
# defines is re-bound here to nn.Module's/object's version, or hidden (_TorchOnly). gradsync's
# ``super().__init__()`` thus lands in nn.Module.__init__, ``super().__setstate__`` in nn.Module's.
_TorchFacade = type(_TorchDDP)("_TorchFacade", (_TorchDDP,), _facade_namespace())


def _compat_getattr(self: Any, name: str) -> Any:
    try:
        return _GRADSYNC_GETATTR(self, name)
    except AttributeError:
        if isinstance(vars(_TorchFacade).get(name), _TorchOnly):
            raise AttributeError(
                f"gradsync: '{name}' belongs to torch's DistributedDataParallel implementation and "
                "gradsync's wrapper does not provide it (this model was built by gradsync through "
                "gradsync.replace_torch_ddp())") from None
        raise


# nn.Module.__getattr__ (parameters, buffers, submodules), unless gradsync's wrapper defines its own
_GRADSYNC_GETATTR = next(vars(k)["__getattr__"] for k in _GradsyncDDP.__mro__ if "__getattr__" in vars(k))

_namespace = {
    "__module__": __name__,
    "__qualname__": "DistributedDataParallel",
    "__doc__": (
        "gradsync's ``DistributedDataParallel`` as built through torch's class while "
        "``gradsync.replace_torch_ddp()`` is active: behaves exactly like "
        "``gradsync.DistributedDataParallel`` and is also an instance of "
        "``torch.nn.parallel.DistributedDataParallel`` for frameworks' isinstance checks."),
    "__getattr__": _compat_getattr,
}

#: The class that ``torch.nn.parallel.DistributedDataParallel(...)`` builds while the replacement is active.
DistributedDataParallel = type(_TorchFacade)("DistributedDataParallel", (_GradsyncDDP, _TorchFacade), _namespace)
del _namespace


_torch_init = _TorchDDP.__init__


@functools.wraps(_torch_init)  # inspect.signature(torch's class) still shows torch's constructor
def _redirecting_init(self: Any, *args: Any, **kwargs: Any) -> None:
    if type(self) is _TorchDDP:
        # A bare instance of torch's class, not yet initialized: make it the compat class and let
        # gradsync initialize it. (Subclasses of torch's class keep torch's behaviour.)
        object.__setattr__(self, "__class__", DistributedDataParallel)
        DistributedDataParallel.__init__(self, *args, **kwargs)
    else:
        _torch_init(self, *args, **kwargs)


_lock = threading.RLock()  # re-entered: the effect's undo runs inside _uninstall
_EFFECT = "replace-torch-ddp"
state = process.state  # redirects: activations in force; redirect_generation: bumped when the redirect ends


def _redirect() -> None:
    if vars(_TorchDDP)["__init__"] is not _torch_init:
        raise RuntimeError("gradsync: torch.nn.parallel.DistributedDataParallel.__init__ was replaced "
                           "by someone else; replace_torch_ddp() will not stack on top of it")
    _TorchDDP.__init__ = _redirecting_init  # type: ignore[method-assign]


def _restore() -> None:
    with _lock:
        _TorchDDP.__init__ = _torch_init  # type: ignore[method-assign]
        state.redirects = 0
        state.redirect_generation += 1  # handles from before are spent (process.uninstall_all())


def _install() -> int:
    """One more activation; return the generation the handle belongs to."""
    with _lock:
        if state.redirects == 0:
            process.install(process.Effect(
                name=_EFFECT, apply=_redirect, undo=_restore,
                reason="code written for torch's DDP (frameworks, a bound class) builds gradsync's "
                       "wrapper; on request only (replace_torch_ddp())"))
        state.redirects += 1
        return state.redirect_generation


def _uninstall(generation: int) -> None:
    with _lock:
        if generation != state.redirect_generation:  # the redirect already ended (process.uninstall_all())
            return
        state.redirects -= 1
        if state.redirects == 0:
            process.uninstall(_EFFECT)


def is_torch_ddp_replaced() -> bool:
    """True while at least one ``replace_torch_ddp()`` is active in this process."""
    return state.redirects > 0


class TorchDDPReplacement:
    """The handle ``replace_torch_ddp()`` returns: a context manager, or call ``undo()``."""

    def __init__(self) -> None:
        self._generation = _install()
        self._active = True

    @property
    def active(self) -> bool:
        return self._active and self._generation == state.redirect_generation

    def undo(self) -> None:
        """Stop redirecting torch's DDP for this handle; idempotent. Models already built stay gradsync's."""
        if self._active:
            self._active = False
            _uninstall(self._generation)

    def __enter__(self) -> TorchDDPReplacement:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.undo()

    def __repr__(self) -> str:
        return f"<gradsync.replace_torch_ddp {'active' if self.active else 'undone'}>"


def replace_torch_ddp() -> TorchDDPReplacement:
    """Make ``torch.nn.parallel.DistributedDataParallel(...)`` build gradsync's wrapper, until undone.

    Takes effect at once and returns a handle: use it as a context manager
    (``with gradsync.replace_torch_ddp(): ...``) or call ``handle.undo()``. Every way of reaching
    torch's class works (``torch.nn.parallel.DistributedDataParallel``, a
    ``from torch.nn.parallel[.distributed] import DistributedDataParallel`` taken at any time), and
    the models built are instances of both ``gradsync.DistributedDataParallel`` and torch's class,
    so frameworks' ``isinstance`` checks pass. Attributes behave as on gradsync's wrapper: torch's
    private helpers are not emulated (they raise ``AttributeError`` naming the torch-only API),
    except the two frameworks call, ``_set_static_graph()`` and ``_get_ddp_logging_data()``
    (``torch_extras.py``). Calls nest; torch's
    class is restored exactly when the last one is undone. Subclasses of torch's class are not
    redirected.
    """
    return TorchDDPReplacement()
