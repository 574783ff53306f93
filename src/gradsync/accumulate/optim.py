"""Optimizer and scheduler wrappers that act only where the accumulator's window ends."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .accumulator import GradientAccumulator


class WindowOptimizer(torch.optim.Optimizer):
    """An optimizer whose step and zero_grad act only where the accumulator's window ends."""

    def __init__(self, optimizer: torch.optim.Optimizer, acc: GradientAccumulator):
        # No Optimizer.__init__: every state lives in the wrapped optimizer. Subclassing keeps
        # isinstance checks (LR schedulers, GradScaler) working.
        self.optimizer = optimizer
        self._acc = acc

    def __getattr__(self, name: str) -> Any:
        if name in ("optimizer", "_acc"):
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    param_groups = property(lambda self: self.optimizer.param_groups,
                            lambda self, v: setattr(self.optimizer, "param_groups", v))
    state = property(lambda self: self.optimizer.state)
    defaults = property(lambda self: self.optimizer.defaults)

    def step(self, closure: Any = None) -> Any:
        if not self._acc.is_boundary or self._acc.window_empty:  # every micro-step skipped: no step
            return None
        self._acc.optimizer_acted()
        # torch's GradScaler sets these on the optimizer it was given, for one that unscales and skips
        # itself (fused Adam/SGD): the wrapped one must see them, or it steps on scaled gradients
        scaling = {k: self.__dict__[k] for k in ("grad_scale", "found_inf") if k in self.__dict__}
        self.optimizer.__dict__.update(scaling)
        try:
            return self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        finally:
            for k in scaling:
                self.optimizer.__dict__.pop(k, None)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._acc.may_zero():
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"WindowOptimizer(steps={self._acc.steps}, {self.optimizer!r})"


class WindowScheduler:
    """A scheduler whose step acts once per window, at the window's end."""

    def __init__(self, scheduler: Any, acc: GradientAccumulator):
        self.scheduler = scheduler
        self._acc = acc
        self._stepped_window = -1

    def __getattr__(self, name: str) -> Any:
        if name in ("scheduler", "_acc", "_stepped_window"):
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def step(self, *args: Any, **kwargs: Any) -> None:
        acc = self._acc
        if acc.is_boundary and acc.windows > 0 and self._stepped_window != acc.windows and not acc.window_empty:
            self._stepped_window = acc.windows
            self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)
