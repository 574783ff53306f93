"""Checkpoints of what a reducer holds mid-window (this rank's gradients and the bucket layout), and clearing it.

Mid-window, the accumulated micro-steps are training state; the layout (re-planned after the
first synced backward) decides the summation order of every later reduction: with three or more
ranks the ring all-reduce's order depends on where a gradient sits in its bucket, so a resumed
run must reduce with the layout the interrupted run had.
"""
from __future__ import annotations

from typing import Any

from torch import nn

_KEYS = {"gradients", "bucket_order", "main_grads", "bucket_caps", "trees"}


def grad_state(reducer: Any) -> dict[str, Any]:
    """Return ``reducer``'s gradients (``.grad``, and ``reduce_dtype``'s window slots) and layout."""
    store = reducer.store
    order = store.plan_order
    state = {"gradients": {name: p.grad.detach().clone() for name, p in zip(reducer.names, reducer.params)
                           if p.grad is not None},
             "bucket_order": None if order is None else [reducer.names[i] for i in order]}
    if store.main is not None:
        state["main_grads"] = store.main.state()
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
    for name, p in zip(names, reducer.params):
        p.grad = grads[name].detach().clone().to(p.device) if name in grads else None
    main = state.get("main_grads", {})
    if main and store.main is None:
        raise ValueError("gradsync: this gradient state holds reduce_dtype accumulation buffers "
                         "('main_grads'); load it into a model built with the same reduce_dtype")
    if store.main is not None:
        store.main.load_state(main)
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
