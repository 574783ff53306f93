"""Which parameters a forward's outputs can reach: the autograd-graph walk behind find_unused_parameters."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from . import messages
from .._torch import caller_frame, queue_end_of_backward

# the frame that runs a custom autograd Function's backward: a backward inside it (a reentrant checkpoint's) is nested
FUNCTION_BACKWARD = torch.autograd.function.BackwardCFunction.apply.__code__


def reachable_params(outputs: Any, index_of: dict[int, int]) -> set[int]:
    """Return the indices (``index_of[id(param)]``) of parameters the outputs' graphs reach."""
    stack = [t.grad_fn for t in tensors(outputs) if t.grad_fn is not None]
    seen: set = set()
    found: set[int] = set()
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)  # an AccumulateGrad node: a leaf, maybe a parameter
        if var is not None:
            i = index_of.get(id(var))
            if i is not None:
                found.add(i)
        stack.extend(nf for nf, _ in fn.next_functions if nf is not None)
    return found


def tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Yield the tensors in nested dicts, lists, tuples and dataclasses (a forward's outputs)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors(v)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            yield from tensors(getattr(obj, name))


def inner_backward_ended(reducer: Any) -> bool:
    """Whether the end-of-backward callback, queued at the first gradient's hook, ran where a backward nested in another
    ended (``checkpoint(use_reentrant=True)`` around the layers that produce the first gradients) with gradients still
    to come, or maybe to come (a first ``static_graph`` backward counts none). Then it is queued again on the enclosing
    backward, from a hook on the custom Function's node that ran the nested one, and nothing steps before that ends.
    torch's DDP queues its callback from a node on the forward's outputs, which only static_graph and
    find_unused_parameters pay for; this costs nothing where no Function runs a backward of its own."""
    frame = caller_frame()  # finish_grad_sync's
    while frame is not None and frame.f_code is not FUNCTION_BACKWARD:
        frame = frame.f_back
    if frame is None:
        return False
    it, first_static = reducer.it, reducer.config.static_graph and reducer.expected.static_counts is None
    if not first_static and all(r or not p.requires_grad for r, p in zip(it.ready, reducer.params)):
        return False  # every gradient is in: finish here
    finish = reducer.finish_grad_sync
    frame.f_locals["self"].register_hook(lambda grad_inputs, grad_outputs: queue_end_of_backward(finish))
    reducer.unsynced = reducer.world_size > 1  # until that end reduces them
    return True


class Expected:
    """Which parameters a synced backward expects gradients from: every one, those a forward's outputs
    reach (``find_unused_parameters``), or each as often as in the first synced backward
    (``static_graph``, learned there)."""

    def __init__(self, index_of: dict[int, int]):
        self.index_of = index_of
        self.static_counts: list[int] | None = None  # static_graph: hooks per parameter, learned once
        self.reachable: set[int] = set()  # find_unused_parameters: reached since the last synced backward
        self.error: tuple[int, str] | None = None  # the latest error raised here, for torch's logging data

    def note_forward(self, outputs: Any, config: Any) -> None:
        if config.find_unused_parameters and not (config.static_graph and self.static_counts is not None):
            self.reachable |= reachable_params(outputs, self.index_of)

    def everyone(self, n: int, world_size: int) -> list[int]:
        """Per parameter, the ranks that produce its gradient, as known before the control (overlap_optimizer):
        every rank, but none for a parameter ``static_graph`` learned is unused."""
        return [world_size] * n if self.static_counts is None else [world_size * bool(c) for c in self.static_counts]

    def unused(self, n: int, config: Any) -> list[int]:
        """Parameters this synced backward will not produce (ready at its start); resets ``reachable``."""
        if config.static_graph and self.static_counts is not None:
            unused = [i for i, c in enumerate(self.static_counts) if c == 0]
        elif config.find_unused_parameters:
            unused = [i for i in range(n) if i not in self.reachable]
        else:
            unused = []
        self.reachable = set()
        return unused

    def ready_now(self, i: int, from_hook: bool, ready: list[bool], hook_counts: list[int], config: Any,
                  name: str) -> bool:
        """Whether parameter ``i`` is ready after this hook (``from_hook``) or forced mark; raise when
        the graph did not behave as promised."""
        if not config.static_graph:
            if ready[i]:
                raise self._logged(RuntimeError(messages.ready_twice(name)))
            return True
        hook_counts[i] += from_hook
        if self.static_counts is None:
            return False  # first synced backward: learn how often each hook fires, launch at the end
        expected = self.static_counts[i]
        if hook_counts[i] > expected:
            raise self._logged(RuntimeError(messages.static_graph_extra(name, hook_counts[i], expected)))
        return not (from_hook and hook_counts[i] < expected)

    def refuse_unfinished(self, hook_counts: list[int], names: list[str], rank: int) -> None:
        """With ``static_graph``, a synced backward raised before its end: refuse the next forward with
        torch's error, naming the parameters whose gradients that backward did not produce."""
        if self.static_counts is None:
            return
        missing = [i for i, c in enumerate(self.static_counts) if hook_counts[i] < c]
        raise self._logged(self.missing_error(missing, names, rank))

    @staticmethod
    def missing_error(missing: list[int], names: list[str], rank: int) -> RuntimeError:
        """torch's error for parameters that produced no gradient though they did in the first iteration."""
        return RuntimeError(messages.static_graph_missing(", ".join(names[i] for i in missing), rank,
                                                          " ".join(map(str, missing))))

    def _logged(self, exc: RuntimeError) -> RuntimeError:
        self.error = messages.logged(exc)  # raised inside a gradient hook: the reducer's end never sees it
        return exc
