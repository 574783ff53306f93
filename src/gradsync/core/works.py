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
hook's callback) finishes while the interpreter is whole.
"""
from __future__ import annotations

import atexit
import time
from typing import Any

_last: Any = None  # one handle: holding more would keep transient buffers (broadcast chunks) alive


def hold(handle: Any) -> None:
    """Keep ``handle`` (a ``dist.Work`` or future about to be waited) referenced until the next one."""
    global _last
    _last = handle


@atexit.register
def _release_gil_before_shutdown() -> None:
    if _last is not None:
        time.sleep(0.01)
