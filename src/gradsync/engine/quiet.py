"""Local backwards without a Python call per gradient.

A local backward (``no_sync``) needs little from a gradient's hook: autograd accumulates into ``.grad`` (with views,
in place into the slot ``.grad`` already is), the step guard needs only to know the window holds local gradients, and
with views a window's first micro-step can have each small ``.grad`` made its zeroed view at once (``lend_views``). So the
first hook of such a backward takes the reducer's hooks out of their parameters' hook dicts, and the end of the
backward (or, after one that raised, the next forward) puts them back in their place. A hook call costs ~2.5 us
from the autograd engine into Python: on 801 small parameters ~2 ms of a 14 ms local backward
(``benchmarks/speed/many_params.py``). An emptied dict still costs the engine's call into it (~1 us), which torch
offers no way to avoid.
"""
from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Sequence
from itertools import compress, repeat
from operator import and_, attrgetter, delitem, is_, is_not, setitem
from typing import Any

import torch

from .._torch import foreach_zero_, post_accumulate_hooks
from .checks import is_view_of
from .layout import MiB


GRAD = attrgetter("grad")
# A missing .grad of at most this many bytes becomes its zeroed view at a window's first local hook: autograd's add into
# it costs ~2 us more than its taking its own new tensor, less than the Python-issued copy into the view that tensor
# needs later (benchmarks/results/speed-many-params-2cpu-2026-11-28.md); a larger one costs more in memory passes.
LEND_BYTES = 16 * 1024


def hook_slots(params: Sequence[torch.Tensor], handles: Sequence[Any], pre: bool = False) -> tuple[list, list, list]:
    """Each parameter's hook dict (``pre``: of tensor hooks), the key of ``handles``' hook in it, and that hook."""
    dicts = [post_accumulate_hooks(p, pre) for p in params]
    keys = [h.id for h in handles]
    return dicts, keys, [d[key] for d, key in zip(dicts, keys)]


def move_last(dicts: Sequence[Any], keys: Sequence[int], hooks: Sequence[Any]) -> None:
    """Each ``hooks[k]`` last in ``dicts[k]``: autograd walks the plain dict's order, which ``move_to_end`` does not
    change, so taken out and put back."""
    for d, key, hook in zip(dicts, keys, hooks):
        if len(d) > 1 and key in d and next(reversed(dict.keys(d))) != key:
            del d[key]
            d[key] = hook


class QuietHooks:
    """The reducer's post-accumulate-grad hooks, taken out for the rest of a local backward and put back."""

    def __init__(self, params: Sequence[torch.Tensor], handles: Sequence[Any]):
        self.params, self.nbytes = params, [p.numel() * p.element_size() for p in params]
        self.small = [n <= LEND_BYTES for n in self.nbytes]
        self.dicts, self.keys, self.hooks = hook_slots(params, handles)
        self.muted: tuple[list, list, list] | tuple[()] = ()  # (dicts, keys, hooks) taken out, until put back
        self.fresh = False  # with views: the muted backward leaves .grad that are not views, taken in at its end
        self.warned = False  # keep_last's warning about a post-accumulate-grad hook under reduce_dtype, once

    def mute(self, store: Any = None) -> bool:
        """Take the hooks out of each parameter that has no other (another's hooks keep their order). With the
        ``store`` of gradient views, a missing ``.grad`` of at most ``LEND_BYTES`` (a window's first micro-step, after
        ``zero_grad``) becomes its zeroed view now (``lend_views``); a larger one, or one autograd replaces
        (``create_graph``), is taken in at the end of the backward, so only while such gradients hold at most one
        bucket cap (``bucket_cap_mb``, or the largest bucket if larger), where the hooks take each bucket's in as it
        completes."""
        if store is not None:
            grads = list(map(GRAD, self.params))
            if not all(map(is_, grads, store.views)):  # the same objects ``.grad = view`` set
                if not torch.is_grad_enabled():  # autograd adds into a .grad in place (no create_graph)
                    grads = lend_views(store, grads, self.small)
                fresh = sum(compress(self.nbytes, map(is_not, grads, store.views)))  # C loops: no call per gradient
                caps = store.caps[0] if isinstance(store.caps[0], tuple) else (store.caps[0],)
                if fresh > max(max(caps) * MiB, *(b.buffer.nbytes for b in store.buckets)):
                    return False
                self.fresh = fresh > 0
        dicts, keys, hooks = self.dicts, self.keys, self.hooks
        if not (all(map((1).__eq__, map(len, dicts))) and all(map(dict.__contains__, dicts, keys))):
            alone = [len(d) == 1 and k in d for d, k in zip(dicts, keys)]  # someone else's hooks keep ours, in order
            dicts, keys, hooks = (list(compress(column, alone)) for column in (dicts, keys, hooks))
        deque(map(delitem, dicts, keys), 0)  # one C loop, no call per parameter
        self.muted = (dicts, keys, hooks) if dicts else ()
        return True

    def keep_last(self, store: Any = None) -> None:
        """Each hook after every other post-accumulate-grad hook of its parameter, as torch's reducer runs after
        AccumulateGrad's: a hook the user registered after wrapping changes the gradient that is reduced. Between
        backwards only (a dict autograd is walking must not change). ``store.main`` (``reduce_dtype``) takes each
        gradient in a tensor hook, before AccumulateGrad: it stays after the user's tensor hooks, and warns of theirs
        after AccumulateGrad, whose change to ``.grad`` no slot would see."""
        main = getattr(store, "main", None)
        if main is not None:
            move_last(*main.pre_hooks)
        if all(map((1).__eq__, map(len, self.dicts))):  # one C loop: no parameter has another hook
            return
        if main is not None and not self.warned:  # a hook that only reads is fine: said once, not refused
            self.warned = True
            name = main.names[next(i for i, d in enumerate(self.dicts) if len(d) > 1)]
            warnings.warn(
                f"gradsync: parameter {name!r} has a hook from register_post_accumulate_grad_hook; with reduce_dtype "
                "each gradient is added into its main_grad slot before AccumulateGrad, so a change that hook makes to "
                ".grad is not reduced (one that only reads is fine). To change the gradient, register the hook with "
                "param.register_hook: it then sees the gradient first.", stacklevel=4)
        move_last(self.dicts, self.keys, self.hooks)

    def unmute(self) -> None:
        if self.muted:
            dicts, keys, hooks = self.muted
            deque(map(setitem, dicts, keys, hooks), 0)  # after any hook registered meanwhile (keep_last)
        self.muted, self.fresh = (), False

    def release(self) -> None:  # the hooks are about to be removed for good
        self.unmute()
        self.dicts, self.keys, self.hooks = [], [], []


def lend_views(store: Any, grads: list[torch.Tensor | None], small: list[bool]) -> list[torch.Tensor | None]:
    """Make each missing small ``.grad`` its zeroed bucket view before autograd accumulates into it (a memset per bucket
    when every gradient is small and none is in a view yet), and take in those autograd already created (the hook's
    own); return the ``.grad`` now. Autograd then adds the small ones in place, so a window's first micro-step leaves
    them nowhere but the views; a larger one stays autograd's own tensor, taken in later, one copy: adding into a
    zeroed view would pass over its memory twice more."""
    views, params = store.views, store.params
    lent = list(map(and_, map(is_, grads, repeat(None)), small))
    present = list(compress(range(len(grads)), map(is_not, grads, repeat(None))))
    fresh = [i for i in present if not is_view_of(grads[i], views[i])]
    if len(fresh) == len(present) and all(small):  # no view holds this window's gradient yet
        for bucket in store.buckets:
            bucket.buffer.zero_()
    else:
        foreach_zero_(list(compress(views, lent)))
    deque(map(setattr, compress(params, lent), repeat("grad"), compress(views, lent)), 0)
    store.lent.update(compress(range(len(params)), lent))  # averaged as copied: torch's .grad is autograd's
    if fresh:
        buckets = {store.bucket_of[i]: store.buckets[store.bucket_of[i]] for i in fresh}
        for i in fresh:
            buckets[store.bucket_of[i]].fresh.append(i)
        store.adopt_views(list(buckets.values()))
    return list(map(GRAD, params))


__all__ = ["hook_slots", "move_last", "LEND_BYTES", "QuietHooks", "lend_views"]
