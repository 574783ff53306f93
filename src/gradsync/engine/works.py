"""Collectives are released from Python, never by gloo's thread while the interpreter shuts down.

A gloo Work started in a backward copies the thread's state, which holds a Python object (the
context the autograd engine stashes for its threads), and a comm hook's future carries Python
callbacks. Whoever drops the last reference to either must take the GIL. When that is gloo's
worker thread after the interpreter began to shut down, taking the GIL ends the thread inside a
noexcept destructor: "terminate called without an active exception" after training finished
(issue 14 item 2). The worker drops its own reference just after the Work completes, so the
handle waited last (the end-of-backward check) stays referenced here until the next wait: its
last reference is then Python's, dropped at runtime or by the interpreter's own teardown on the
main thread. At exit the GIL is released once, so that a worker still waiting for it (to drop a
hook's callback) finishes while the interpreter is whole: an atexit function, registered with the
first handle held (the process-wide effect ``exit-hook``, process.py).
"""
from __future__ import annotations

import atexit
import time
from typing import Any

from .. import process

_last: Any = None  # one handle: holding more would keep transient buffers (broadcast chunks) alive
_at_exit = False  # the exit hook is registered


def hold(handle: Any) -> None:
    """Keep ``handle`` (a ``dist.Work`` or future about to be waited) referenced until the next one."""
    global _last
    _last = handle
    if not _at_exit:
        process.install(process.Effect(
            name="exit-hook", apply=_register, undo=_unregister,
            reason="a collective's last reference dropped by gloo's thread during interpreter "
                   "shutdown aborts the process; at exit the GIL is released once so it is not"))


def _register() -> None:
    global _at_exit
    atexit.register(_release_gil_before_shutdown)
    _at_exit = True


def _unregister() -> None:
    global _at_exit
    atexit.unregister(_release_gil_before_shutdown)
    _at_exit = False


def _release_gil_before_shutdown() -> None:
    if _last is not None:
        time.sleep(0.01)
