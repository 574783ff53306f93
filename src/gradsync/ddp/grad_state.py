"""Checkpoints of what a reducer holds mid-window (this rank's gradients and the bucket layout), and clearing it.

Mid-window, the accumulated micro-steps are training state; the layout (re-planned after the
first synced backward) decides the summation order of every later reduction: with three or more
ranks the ring all-reduce's order depends on where a gradient sits in its bucket, so a resumed
run must reduce with the layout the interrupted run had.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from ..engine.checks import is_view_of

_KEYS = {"gradients", "bucket_order", "main_grads", "main_written", "bucket_caps", "trees", "world_size", "views", "lent",
         "used"}


def holds_window(state: dict[str, Any]) -> bool:
    """Whether a ``grad_state()`` carries an unfinished window (a gradient that is not zero, or reduce_dtype slots)."""
    return any(bool(g.any()) for g in state["gradients"].values()) or bool(state.get("main_grads"))


def grad_state(reducer: Any) -> dict[str, Any]:
    """Return ``reducer``'s gradients (``.grad``, and ``reduce_dtype``'s window slots) and layout."""
    store = reducer.store
    order = store.plan_order
    state = {"gradients": {name: p.grad.detach().clone() for name, p in zip(reducer.names, reducer.params)
                           if p.grad is not None},
             "bucket_order": None if order is None else [reducer.names[i] for i in order],
             "world_size": reducer.world_size,
             "used": [n for n, used in zip(reducer.names, reducer.window_used) if used]}  # the rest holds synced ones
    if getattr(store, "grad_as_view", False) and store.main is None:  # which .grad were views, and which lent
        state["views"] = [n for n, p, v in zip(reducer.names, reducer.params, store.views) if is_view_of(p.grad, v)]
        state["lent"] = [reducer.names[i] for i in sorted(store.lent)]
    if store.main is not None:
        state["main_grads"], state["main_written"] = store.main.state()
    if hasattr(store, "tree_state"):  # deterministic=True: the window is in per-parameter trees, not .grad
        state["trees"] = store.tree_state()
    if reducer.auto_caps is not None and reducer.auto_caps.choice is not None:
        state["bucket_caps"] = list(store.caps)
    return state


def load_grad_state(reducer: Any, state: dict[str, Any]) -> None:
    """Restore ``grad_state()`` of the same rank; a layout only before the first backward."""
    if not {"gradients", "bucket_order"} <= set(state) <= _KEYS:
        raise KeyError("gradsync: expected a dict from model.grad_state_dict() with keys 'gradients' "
                       f"and 'bucket_order', got keys {sorted(state)[:5]}")
    names, store = reducer.names, reducer.store
    grads, order = state["gradients"], state["bucket_order"]
    saved_at = state.get("world_size", reducer.world_size)
    if saved_at != reducer.world_size and holds_window(state):  # each rank's share of a W-rank window
        raise ValueError(
            f"gradsync: this gradient state holds an unfinished window, saved at world size {saved_at}; it cannot "
            f"load at {reducer.world_size} (each rank's gradients are its share of that window). Resume mid-window "
            "at the same world size, or checkpoint between windows (after zero_grad)")
    unknown = set(grads) - set(names)
    if order is not None:
        unknown |= set(order) - set(names)
    if unknown or (order is not None and len(order) != len(names)):
        raise KeyError("gradsync: the gradient state does not match this model's parameters "
                       f"(unknown: {sorted(unknown)[:5]}); load it into the model it was saved from")
    if order is not None:
        if reducer.backward_count:
            raise RuntimeError("gradsync: load_grad_state_dict() must come before the first backward")
        caps = None
        if "bucket_caps" in state and reducer.auto_caps is not None:  # the interrupted run's choice
            caps = reducer.auto_caps.resume(*state["bucket_caps"])
        index = {name: i for i, name in enumerate(names)}
        reducer.layout.replan([index[name] for name in order], caps)
    views = set(state.get("views", ())) if getattr(store, "grad_as_view", False) and store.main is None else set()
    for i, (name, p) in enumerate(zip(names, reducer.params)):
        p.grad = grads[name].detach().clone().to(p.device) if name in grads else None
        if name in views and p.grad is not None:  # a view again: averaged as it would have been (bucket.average)
            p.grad = store.views[i].copy_(p.grad)
    if views:
        lent = set(state.get("lent", ()))
        store.lent = {i for i, name in enumerate(names) if name in lent}
    used = set(state["used"]) if "used" in state else set(grads)  # this window's own: the next synced backward reduces them
    reducer.window_used = [name in grads and name in used for name in names]
    if "used" in state and hasattr(store, "restored_synced"):  # sync_each_batch: an average, not this window's own
        store.restored_synced = {i for i, name in enumerate(names) if name in grads and name not in used}
    main = state.get("main_grads", {})
    if main and store.main is None:
        raise ValueError("gradsync: this gradient state holds reduce_dtype accumulation buffers "
                         "('main_grads'); load it into a model built with the same reduce_dtype")
    if store.main is not None:
        store.main.load_state(main, state.get("main_written", ()))
    if ("trees" in state) != hasattr(store, "tree_state"):
        raise ValueError("gradsync: a gradient state saved with deterministic=True loads only into a model built with "
                         "it, and the other way round (the window's gradients live in its trees)")
    if "trees" in state:
        store.load_tree_state(state["trees"])


def zero_grad(ddp: Any, set_to_none: bool = True) -> None:
    """``nn.Module.zero_grad``, and with ``reduce_dtype`` the window's slots: there, not in ``.grad`` (None inside a
    window), the ``no_sync`` micro-steps' gradients wait, and the next synced backward would reduce them."""
    nn.Module.zero_grad(ddp, set_to_none)
    if (main := ddp.reducer.store.main) is not None:
        main.forget_window()
