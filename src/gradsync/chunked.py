"""``Chunked``: run a memory-heavy module chunk by chunk along dim 0, in forward and in backward.

Forward runs every chunk without autograd (no activations kept) and stitches the outputs.
Backward recomputes one chunk at a time with autograd on and back-propagates it, so only one
chunk's activations are alive at once. The module's trainable parameters are inputs of one
autograd Function whose backward sums their gradients over the chunks and returns them: each
parameter's AccumulateGrad (and so gradsync's ready hook) runs once per backward, as the reducer
requires, instead of once per chunk.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ._torch import BatchNormBase
from .tree import flatten, row_bounds, unflatten


class Chunked(nn.Module):
    """Run ``module`` on ``chunks`` slices of its batch: same outputs and gradients, less memory.

    Every tensor argument whose dim 0 matches the first tensor argument's is split; other
    arguments go whole to every chunk. The module must treat rows independently (no BatchNorm in
    training mode) and update no buffer in forward; every output tensor must have the chunk's rows
    in dim 0, and other outputs must be equal in every chunk. Random ops (dropout) replay the same
    random numbers when recomputed.
    """

    def __init__(self, module: nn.Module, chunks: int = 4):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"gradsync: Chunked wraps an nn.Module, got {type(module).__name__}")
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"gradsync: chunks must be an integer >= 1, got {chunks!r}")
        self.module = module
        self.chunks = chunks
        self._buffers_checked: dict[bool, int] = {}  # training mode -> its forwards so far (two are checked)

    def extra_repr(self) -> str:
        return f"chunks={self.chunks}"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # compiled, dropout would draw from the compiler's generator, which the
            # recomputation in backward (eager) cannot replay: the chunks run eagerly, a graph break
            return torch.compiler.disable(self.chunked_forward, recursive=True)(*args, **kwargs)
        return self.chunked_forward(*args, **kwargs)

    def chunked_forward(self, *args: Any, **kwargs: Any) -> Any:
        params = [p for p in self.module.parameters() if p.requires_grad]
        leaves, spec = flatten((args, kwargs))
        tensors = [(i, x) for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        needs_grad = bool(params) or any(x.requires_grad for _, x in tensors)
        if not torch.is_grad_enabled() or not needs_grad:
            return self.module(*args, **kwargs)  # nothing is kept for backward anyway
        batched = [x for _, x in tensors if x.dim() > 0]
        if not batched:
            raise ValueError("gradsync: Chunked needs at least one tensor argument with a batch dimension")
        self._check_rows_independent()
        rows = batched[0].shape[0]
        if rows == 0:  # an empty micro-batch (num_items=0): nothing to chunk
            return self.module(*args, **kwargs)
        plan = _Plan(self.module, spec, leaves, [i for i, _ in tensors],
                     [x.dim() > 0 and x.shape[0] == rows for _, x in tensors],
                     row_bounds(rows, min(self.chunks, rows)), params)
        # comparing the buffers' values waits for the device: the first two forwards per mode only. A buffer set once
        # (a lazy initialization) changes in chunk 0 of the first: with one chunk there, the second is checked
        mode, seen = self.module.training, self._buffers_checked.get(self.module.training, 0)
        plan.check_buffers = seen == 1 or (seen == 0 and len(plan.bounds) > 1)
        outputs = _ChunkedFunction.apply(plan, *(x for _, x in tensors), *params)
        self._buffers_checked[mode] = seen + 1
        return plan.rebuild_output(outputs)

    def _check_rows_independent(self) -> None:
        for name, m in self.module.named_modules():
            if isinstance(m, BatchNormBase) and m.training:
                raise ValueError(
                    f"gradsync: Chunked module contains {type(m).__name__} '{name}' in training mode; "
                    "it mixes rows, so chunks would change its statistics (and recomputation would "
                    "update its running stats twice). Chunk a part without batch norm, or call eval()."
                )


@dataclass(eq=False)
class _Plan:
    """How to call the module on one chunk and how to rebuild its outputs."""

    module: nn.Module
    spec: Any
    leaves: list[Any]
    tensor_at: list[int]  # positions of the tensor arguments among the flattened leaves
    split: list[bool]  # per tensor argument: sliced per chunk (else passed whole)
    bounds: list[tuple[int, int]]  # (start, length) per chunk
    params: list[nn.Parameter]
    rng: list[Any] = field(default_factory=list)
    autocast: list[tuple[str, bool, torch.dtype]] = field(default_factory=list)
    out_spec: Any = None
    out_leaves: list[Any] = field(default_factory=list)  # non-tensor outputs, None at tensor slots
    out_is_tensor: list[bool] = field(default_factory=list)
    check_buffers: bool = False

    def chunk_inputs(self, inputs: list[torch.Tensor], k: int) -> list[torch.Tensor]:
        start, length = self.bounds[k]
        return [x.narrow(0, start, length) if s else x for x, s in zip(inputs, self.split)]

    def call(self, inputs: list[torch.Tensor]) -> tuple[list[Any], Any]:
        leaves = list(self.leaves)
        for i, x in zip(self.tensor_at, inputs):
            leaves[i] = x
        args, kwargs = unflatten(leaves, self.spec)
        return flatten(self.module(*args, **kwargs))

    def rebuild_output(self, tensors: tuple[torch.Tensor, ...]) -> Any:
        it = iter(tensors)
        leaves = [next(it) if is_t else v for is_t, v in zip(self.out_is_tensor, self.out_leaves)]
        return unflatten(leaves, self.out_spec)


class _ChunkedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: _Plan, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n_in = len(plan.tensor_at)
        inputs = list(tensors[:n_in])
        devices = _cuda_devices(tensors)
        plan.autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                         for d in ("cpu", "cuda") if d == "cpu" or devices]
        per_chunk: list[list[Any]] = []
        last = len(plan.bounds) - 1
        for k in range(len(plan.bounds)):
            plan.rng.append(_rng_state(devices))
            # the last chunk, not the first: a buffer set once (a lazy initialization) is not refused
            before = _buffers(plan.module) if plan.check_buffers and k == last else None
            leaves, spec = plan.call(plan.chunk_inputs(inputs, k))
            if before is not None:
                _check_buffers_unchanged(plan.module, before, 2 * len(plan.bounds))
            if k == 0:
                plan.out_spec = spec
                plan.out_is_tensor = [isinstance(v, torch.Tensor) for v in leaves]
                plan.out_leaves = [None if t else v for t, v in zip(plan.out_is_tensor, leaves)]
            elif spec != plan.out_spec or plan.out_is_tensor != [isinstance(v, torch.Tensor) for v in leaves]:
                raise ValueError("gradsync: the Chunked module returned differently structured outputs "
                                 "for different chunks")
            _check_outputs(plan, k, leaves)
            per_chunk.append([v for v in leaves if isinstance(v, torch.Tensor)])
        outputs = tuple(torch.cat(parts) for parts in zip(*per_chunk))
        ctx.mark_non_differentiable(*(o for o in outputs if not (o.is_floating_point() or o.is_complex())))
        ctx.plan = plan
        ctx.devices = devices
        ctx.save_for_backward(*tensors)  # parameters too: an in-place update before backward raises
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable  # the recomputation does not build a graph
    def backward(ctx, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        plan: _Plan = ctx.plan
        n_in = len(plan.tensor_at)
        inputs = list(ctx.saved_tensors[:n_in])
        need_in = ctx.needs_input_grad[1:1 + n_in]
        need_params = ctx.needs_input_grad[1 + n_in:]
        wanted_params = [p for p, need in zip(plan.params, need_params) if need]
        # split inputs: filled chunk by chunk (no list of pieces to cat); whole inputs: summed
        in_grads: list[torch.Tensor | None] = [torch.empty_like(x) if need and s else None
                                               for x, need, s in zip(inputs, need_in, plan.split)]
        param_grads: list[torch.Tensor | None] = [None] * len(wanted_params)
        owned = [False] * len(wanted_params)  # safe to add the next chunks into in place
        incoming = {_storage(g) for g in grad_outputs if g is not None}
        for k, (start, length) in enumerate(plan.bounds):
            chunk = [x.detach().requires_grad_(need)
                     for x, need in zip(plan.chunk_inputs(inputs, k), need_in)]
            with torch.enable_grad(), _replay(plan, k, ctx.devices):
                leaves, _ = plan.call(chunk)
            outs = [v for v in leaves if isinstance(v, torch.Tensor)]
            pairs = [(o, g.narrow(0, start, length)) for o, g in zip(outs, grad_outputs)
                     if g is not None and o.requires_grad]
            wrt = [x for x, need in zip(chunk, need_in) if need] + wanted_params
            got: tuple[torch.Tensor | None, ...] = (None,) * len(wrt)
            if pairs and wrt:
                got = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                          allow_unused=True)
            seen = [_storage(g) for g in got if g is not None]
            # grad() may pass an incoming gradient through, or hand one tensor to several inputs
            shared = incoming | {ptr for ptr in seen if seen.count(ptr) > 1}
            got_it = iter(got)
            for j, (x, need) in enumerate(zip(chunk, need_in)):
                if not need:
                    continue
                g = next(got_it)
                if plan.split[j]:
                    part = in_grads[j].narrow(0, start, length)
                    part.zero_() if g is None else part.copy_(g)
                elif g is not None:
                    in_grads[j] = g if in_grads[j] is None else in_grads[j] + g
            for j, g in enumerate(got_it):
                if g is None:
                    continue
                if param_grads[j] is None:
                    param_grads[j], owned[j] = g, _storage(g) not in shared
                elif owned[j]:
                    param_grads[j].add_(g)
                else:
                    param_grads[j], owned[j] = param_grads[j] + g, True
        result: list[torch.Tensor | None] = [None, *in_grads]  # None: the plan
        grads_it = iter(param_grads)
        result += [next(grads_it) if need else None for need in need_params]
        return tuple(result)


def _check_outputs(plan: _Plan, k: int, leaves: list[Any]) -> None:
    rows = plan.bounds[k][1]
    for v, first in zip(leaves, plan.out_leaves):
        if isinstance(v, torch.Tensor):
            if v.dim() == 0 or v.shape[0] != rows:
                got = ("a 0-dim tensor" if v.dim() == 0
                       else f"a tensor of shape {tuple(v.shape)} for a chunk of {rows} rows")
                raise ValueError(f"gradsync: a Chunked module must return tensors with a batch dimension to stitch "
                                 f"along; it returned {got}. Return one row per input row, and reduce outside Chunked.")
        elif k > 0 and not _equal(v, first):
            raise ValueError(f"gradsync: the Chunked module returned a non-tensor output that differs between chunks "
                             f"({first!r} in chunk 0, {v!r} in chunk {k}); Chunked cannot stitch it. Return it as a "
                             "tensor with one row per input row, or compute it outside Chunked.")


def _equal(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # an == without a truth value (an array): not known to be equal
        return False


def _buffers(module: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {name: (b, b.clone()) for name, b in module.named_buffers()}


def _check_buffers_unchanged(module: nn.Module, before: dict[str, tuple[torch.Tensor, torch.Tensor]],
                             runs: int) -> None:
    after = dict(module.named_buffers())
    for name in sorted(before.keys() | after.keys()):
        b, copy = before.get(name, (None, None))
        if after.get(name) is not b or not _same_values(b, copy):
            raise ValueError(f"gradsync: Chunked module changed its buffer '{name}' in forward; Chunked runs the "
                             f"module twice per chunk (forward, then again in backward), so the buffer would be "
                             f"updated {runs} times. Update it outside the Chunked part, or call eval() if it is "
                             "only updated in training.")


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan_is_nan = a.is_floating_point() or a.is_complex()  # an unchanged NaN is not == itself
    return torch.equal(a, b) or (nan_is_nan and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True))


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _cuda_devices(tensors: tuple[torch.Tensor, ...]) -> list[int]:
    return sorted({t.device.index for t in tensors if t.is_cuda})


def _rng_state(devices: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]


@contextlib.contextmanager
def _replay(plan: _Plan, k: int, devices: list[int]):
    """Recompute chunk ``k`` with its forward's random state and autocast, leaving the RNG as it was."""
    cpu_state, cuda_states = plan.rng[k]
    with torch.random.fork_rng(devices=devices), contextlib.ExitStack() as stack:
        torch.set_rng_state(cpu_state)
        for d, state in zip(devices, cuda_states):
            torch.cuda.set_rng_state(state, d)
        for device_type, enabled, dtype in plan.autocast:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
        yield
