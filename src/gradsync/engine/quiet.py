"""Local backwards without a Python call per gradient.

A local backward (``no_sync``) needs little from a gradient's hook: autograd accumulates into ``.grad`` (with views,
in place into the slot ``.grad`` already is), the step guard needs only to know the window holds local gradients, and
with views a ``.grad`` autograd created (a window's first micro-step) can be taken into its view at the end. So the
first hook of such a backward takes the reducer's hooks out of their parameters' hook dicts, and the end of the
backward (or, after one that raised, the next forward) puts them back in their place. A hook call costs ~2.5 us
from the autograd engine into Python: on 801 small parameters ~2 ms of a 14 ms local backward
(``benchmarks/speed/many_params.py``). An emptied dict still costs the engine's call into it (~1 us), which torch
offers no way to avoid.
"""
from __future__ import annotations

from collections.abc import Sequence
from itertools import compress
from operator import attrgetter, is_, is_not
from typing import Any

import torch

from .._torch import post_accumulate_hooks
from .layout import MiB


GRAD = attrgetter("grad")


class QuietHooks:
    """The reducer's post-accumulate-grad hooks, taken out for the rest of a local backward and put back."""

    def __init__(self, params: Sequence[torch.Tensor], handles: Sequence[Any]):
        self.params, self.nbytes = params, [p.numel() * p.element_size() for p in params]
        self.entries = [(hooks, h.id, hooks[h.id]) for hooks, h in zip(map(post_accumulate_hooks, params), handles)]
        self.muted: list[tuple[Any, int, Any]] = []
        self.fresh = False  # with views: the muted backward may leave a .grad that is not its view

    def mute(self, store: Any = None) -> bool:
        """Take the hooks out of each parameter that has no other (another's hooks keep their order). With the
        ``store`` of gradient views, a ``.grad`` that is not its view (a window's first micro-step, after ``zero_grad``)
        is taken in at the end of the backward, with every other, where the hooks take each bucket's in as it completes:
        so only while such gradients hold at most one bucket cap (``bucket_cap_mb``, or the largest bucket if larger)."""
        if store is not None:
            grads = list(map(GRAD, self.params))
            if not all(map(is_, grads, store.views)):  # the same objects ``.grad = view`` set
                fresh = sum(compress(self.nbytes, map(is_not, grads, store.views)))  # C loops: no call per gradient
                caps = store.caps[0] if isinstance(store.caps[0], tuple) else (store.caps[0],)
                if fresh > max(max(caps) * MiB, *(b.buffer.nbytes for b in store.buckets)):
                    return False
                self.fresh = True
        self.muted = [e for e in self.entries if len(e[0]) == 1 and e[1] in e[0]]
        for hooks, key, _ in self.muted:
            del hooks[key]
        return True

    def unmute(self) -> None:
        for hooks, key, hook in self.muted:
            hooks[key] = hook
            if len(hooks) > 1:  # registered since it was taken out: it ran first
                hooks.move_to_end(key, last=False)
        self.muted, self.fresh = [], False

    def release(self) -> None:  # the hooks are about to be removed for good
        self.unmute()
        self.entries = []


__all__ = ["QuietHooks"]
