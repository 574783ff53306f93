"""Local backwards without a Python call per gradient.

A local backward (``no_sync``) needs little from a gradient's hook: autograd accumulates into ``.grad`` (with views,
in place into the slot ``.grad`` already is), the step guard needs only to know the window holds local gradients, and
with views a window's first micro-step can have every ``.grad`` made its zeroed view at once (``lend_views``). So the
first hook of such a backward takes the reducer's hooks out of their parameters' hook dicts, and the end of the
backward (or, after one that raised, the next forward) puts them back in their place. A hook call costs ~2.5 us
from the autograd engine into Python: on 801 small parameters ~2 ms of a 14 ms local backward
(``benchmarks/speed/many_params.py``). An emptied dict still costs the engine's call into it (~1 us), which torch
offers no way to avoid.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from itertools import compress, repeat
from operator import attrgetter, delitem, is_, is_not, not_, setitem
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
        self.dicts, self.keys, self.hooks = ([e[k] for e in self.entries] for k in range(3))
        self.muted: list[tuple[Any, int, Any]] = []
        self.fresh = False  # with views under create_graph: the muted backward leaves .grad that are not views

    def mute(self, store: Any = None) -> bool:
        """Take the hooks out of each parameter that has no other (another's hooks keep their order). With the
        ``store`` of gradient views, a ``.grad`` that is not its view (a window's first micro-step, after ``zero_grad``)
        becomes its view now (``lend_views``); under ``create_graph``, where autograd replaces every ``.grad``, they are
        taken in at the end of the backward, so only while they hold at most one bucket cap (``bucket_cap_mb``, or the
        largest bucket if larger), where the hooks take each bucket's in as it completes."""
        if store is not None:
            grads = list(map(GRAD, self.params))
            if not all(map(is_, grads, store.views)):  # the same objects ``.grad = view`` set
                if not torch.is_grad_enabled():  # autograd adds into a .grad in place (no create_graph)
                    lend_views(store, grads)
                else:
                    fresh = sum(compress(self.nbytes, map(is_not, grads, store.views)))  # C loops: no call per gradient
                    caps = store.caps[0] if isinstance(store.caps[0], tuple) else (store.caps[0],)
                    if fresh > max(max(caps) * MiB, *(b.buffer.nbytes for b in store.buckets)):
                        return False
                    self.fresh = True
        entries, dicts, keys = self.entries, self.dicts, self.keys
        if all(map((1).__eq__, map(len, dicts))) and all(map(dict.__contains__, dicts, keys)):
            self.muted = entries  # each parameter holds only ours: out in one C loop
            deque(map(delitem, dicts, keys), 0)
            return True
        self.muted = [e for e in entries if len(e[0]) == 1 and e[1] in e[0]]
        for hooks, key, _ in self.muted:
            del hooks[key]
        return True

    def unmute(self) -> None:
        muted = self.muted
        if muted is self.entries:  # all of them (mute's C loop)
            dicts = self.dicts
            deque(map(setitem, dicts, self.keys, self.hooks), 0)
        else:
            dicts = [e[0] for e in muted]
            deque(map(setitem, dicts, [e[1] for e in muted], [e[2] for e in muted]), 0)
        if not all(map((1).__eq__, map(len, dicts))):
            for hooks, key, _ in muted:
                if len(hooks) > 1:  # registered since it was taken out: it ran first
                    hooks.move_to_end(key, last=False)
        self.muted, self.fresh = [], False

    def release(self) -> None:  # the hooks are about to be removed for good
        self.unmute()
        self.entries, self.dicts, self.keys, self.hooks = [], [], [], []


def lend_views(store: Any, grads: list[torch.Tensor | None]) -> None:
    """Make every ``.grad`` its bucket view before autograd accumulates into it: a missing one a zeroed view (a
    memset per bucket when no view holds a gradient), one autograd already created (the hook's own) copied in.
    Autograd then adds the rest in place, so a window's first micro-step leaves no gradient outside the views."""
    views, params, ptrs = store.views, store.params, store.view_ptrs
    missing = list(map(is_, grads, repeat(None)))
    present = list(compress(range(len(grads)), map(not_, missing)))
    fresh = [i for i in present if grads[i] is not views[i] and grads[i].data_ptr() != ptrs[i]]
    if len(fresh) < len(present):  # some view holds this window's gradient: zero only the others
        for view in compress(views, missing):
            view.zero_()
    else:
        for bucket in store.buckets:
            bucket.buffer.zero_()
    deque(map(setattr, compress(params, missing), repeat("grad"), compress(views, missing)), 0)
    if fresh:
        buckets = {store.bucket_of[i]: store.buckets[store.bucket_of[i]] for i in fresh}
        for i in fresh:
            buckets[store.bucket_of[i]].fresh.append(i)
        store.adopt_views(list(buckets.values()))


__all__ = ["QuietHooks", "lend_views"]
