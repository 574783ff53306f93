"""``ShardedOptimizer``: step this rank's shard of the parameters, then all-gather them.

Each rank owns the same range of every bucket's flat buffer as its gradient shard. The inner
torch optimizer gets one tensor per (parameter, rank) piece of that range, so optimizer state
is 1/W per rank, per-parameter options (param groups) work, and a parameter that received no
gradient on any rank is skipped exactly as torch skips a ``grad is None`` parameter. Pieces
are views of a master shard: the bucket's own parameter memory when the parameters are fp32
or wider, else an fp32 copy (master weights for low-precision parameters). With bf16 or fp16
parameters the inner optimizer therefore steps fp32 master weights from the fp32 gradient shard
(fp32 or wider, and ``reduce_dtype`` wide when given), and the parameters are the masters rounded.

The optimizer must be element-wise (SGD, Adam, AdamW, RMSprop, Adagrad, ...): it sees flat
pieces, not parameter shapes. ``state_dict()`` gathers the full, unsharded state in torch's
per-parameter format (keyed like torch: by position in the concatenated groups' parameter
lists; by default one group of the trainable parameters in ``module.parameters()`` order), so
checkpoints move between world sizes and to and from torch optimizers with the same groups.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from .wrapper import ShardedDataParallel
from .comm import start_all_gather
from .prefetch import Gathers


class _Piece:
    __slots__ = ("index", "param", "offset", "tensor", "grad")

    def __init__(self, index: int, param: int, offset: int, tensor: torch.Tensor, grad: torch.Tensor):
        self.index, self.param, self.offset, self.tensor, self.grad = index, param, offset, tensor, grad


class ShardedOptimizer(torch.optim.Optimizer):
    """Run ``optimizer_class`` on this rank's shard of a ``ShardedDataParallel`` model.

    ``kwargs`` go to ``optimizer_class``. ``param_groups`` (optional) is a list of dicts like
    torch's, ``{"params": [model parameters], **options}``; by default all trainable
    parameters form one group. ``param_groups`` on the result are the inner optimizer's groups,
    so learning-rate schedulers work; their ``"params"`` hold the shard pieces.

    ``prefetch=True`` (opt-in) lets ``step()`` return before the parameter all-gathers finish:
    each bucket's is waited just before a torch function first uses memory of that bucket (a
    ``TorchFunctionMode`` checks the tensor arguments of every torch function until the end of the
    wrapper's next forward, a few microseconds per op), and everything is waited at the end of that
    forward, at the next ``step()`` and in ``state_dict()``/``load_state_dict()``. Memory read
    without a torch function (raw pointers, ``torch.distributed`` calls on parameters) needs
    ``wait_for_params()`` first. Under ``torch.compile`` everything is waited at forward entry.
    """

    def __init__(self, model: ShardedDataParallel, optimizer_class: Callable[..., torch.optim.Optimizer],
                 *, param_groups: Iterable[dict] | None = None, prefetch: bool = False, **kwargs: Any):
        if not isinstance(model, ShardedDataParallel):
            raise TypeError(f"gradsync: ShardedOptimizer needs a gradsync.ShardedDataParallel model, got "
                            f"{type(model).__name__}; wrap the module in ShardedDataParallel first")
        if not isinstance(prefetch, bool):
            raise TypeError(f"gradsync: ShardedOptimizer's prefetch must be True or False, got "
                            f"{type(prefetch).__name__} {prefetch!r}")
        self.prefetch = prefetch
        self.model = model
        self.reducer = reducer = model.reducer
        store = reducer.store
        self._masters: list[torch.Tensor] = []
        pieces_of: dict[int, _Piece] = {}
        for b in reducer.buckets:
            start, end = store.shard_range(b)
            own = b.flat_param[start:end]
            master = own if own.dtype == b.grad_shard.dtype else own.to(b.grad_shard.dtype)
            self._masters.append(master)
            for i, off in zip(b.members, b.offsets):
                lo, hi = max(off, start), min(off + reducer.params[i].numel(), end)
                if lo < hi:
                    pieces_of[i] = _Piece(-1, i, lo - off, master[lo - start:hi - start],
                                          b.grad_shard[lo - start:hi - start])

        groups = self._user_groups(param_groups)
        # like torch: state is keyed by position in the concatenated groups' parameter lists
        order = [i for members, _ in groups for i in members]
        self._state_index = {i: k for k, i in enumerate(order)}
        self._state_shape = [reducer.params[i].shape for i in order]
        self._group_params, k = [], 0
        for members, _ in groups:
            self._group_params.append(list(range(k, k + len(members))))
            k += len(members)
        self._pieces: list[_Piece] = []
        inner_groups = []
        for members, options in groups:
            tensors = []
            for i in members:
                if i in pieces_of:
                    piece = pieces_of[i]
                    piece.index = len(self._pieces)
                    self._pieces.append(piece)
                    tensors.append(piece.tensor)
            inner_groups.append({**options, "params": tensors})
        self.optimizer = optimizer_class(inner_groups, **kwargs)
        self._bucket_pieces: list[list[_Piece]] = [[] for _ in reducer.buckets]
        for piece in self._pieces:
            self._bucket_pieces[store.bucket_of[piece.param]].append(piece)
        self._initializing = True
        super().__init__(self.optimizer.param_groups, self.optimizer.defaults)
        self._initializing = False
        self._link()
        if prefetch and store.gathers is None:
            store.gathers = Gathers(reducer)

    def _user_groups(self, param_groups: Iterable[dict] | None) -> list[tuple[list[int], dict]]:
        reducer = self.reducer
        if param_groups is None:
            return [(list(range(len(reducer.params))), {})]
        index = {id(p): i for i, p in enumerate(reducer.params)}
        groups, seen = [], set()
        for g in param_groups:
            if not isinstance(g, dict) or "params" not in g:
                raise TypeError("gradsync: param_groups must be a list of dicts with a 'params' list of "
                                "the model's parameters, like torch.optim's parameter groups")
            params = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
            members = []
            for p in params:
                i = index.get(id(p))
                if i is None:
                    raise ValueError("gradsync: a param_groups entry holds a tensor that is not a trainable "
                                     "parameter of the wrapped model")
                if i in seen:
                    raise ValueError(f"gradsync: parameter '{reducer.names[i]}' appears in more than one "
                                     "parameter group")
                seen.add(i)
                members.append(i)
            groups.append((members, {k: v for k, v in g.items() if k != "params"}))
        return groups

    def _link(self) -> None:
        # share the inner optimizer's groups and state: schedulers edit what the inner one reads
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state

    def add_param_group(self, param_group: dict) -> None:
        if not getattr(self, "_initializing", False):
            raise NotImplementedError("gradsync: ShardedOptimizer cannot add parameter groups after "
                                      "construction; pass every group in param_groups=")
        super().add_param_group(param_group)

    # ---------------------------------------------------------------- stepping
    @property
    def pending_gathers(self) -> list[int]:
        """Indices of the buckets whose parameter all-gather is started but not waited yet."""
        gathers = self.reducer.store.gathers
        return [] if gathers is None else gathers.pending

    def wait_for_params(self) -> None:
        """Wait for every pending parameter all-gather (prefetch=True)."""
        if self.reducer.store.gathers is not None:
            self.reducer.store.gathers.finish()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradient shards (and any local gradients from no_sync micro-steps)."""
        self.reducer.store.zero_grad(set_to_none)
        for piece in self._pieces:
            piece.tensor.grad = None

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step this rank's shard, then all-gather the updated parameters to every rank."""
        self.wait_for_params()  # the shard is about to change, and new collectives to start
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        reducer, store = self.reducer, self.reducer.store
        store.check_ready_to_step()
        for piece in self._pieces:
            piece.tensor.grad = None
        # bucket by bucket (the optimizer is element-wise), so that each bucket's all-gather runs
        # while the optimizer steps the next one
        works: dict[int, list] = {}
        for b, master, pieces in zip(reducer.buckets, self._masters, self._bucket_pieces):
            stepped = [p for p in pieces if store.has_grad[p.param]]
            if stepped:
                for piece in stepped:
                    piece.tensor.grad = piece.grad
                self.optimizer.step()
                for piece in stepped:
                    piece.tensor.grad = None
            start, end = store.shard_range(b)
            own = b.flat_param[start:end]
            if master is not own:
                own.copy_(master)
            if reducer.world_size > 1:
                works[b.index] = start_all_gather(b.flat_param, b.shard_numel, reducer.rank, reducer.group,
                                                  reducer.launcher.exchange)
        for piece in self._pieces:
            piece.tensor.grad = piece.grad if store.has_grad[piece.param] else None
        if not (self.prefetch and store.gathers.defer(works)):
            for index, bucket_works in works.items():
                for work in bucket_works:
                    reducer.wait(work, f"the parameter all-gather of bucket {index}")
        return loss

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Return the full (unsharded) optimizer state in torch's format; collective: call on every rank."""
        self.wait_for_params()
        inner = self.optimizer.state_dict()
        local = []
        for k, st in inner["state"].items():
            piece = self._pieces[k]
            local.append((self._state_index[piece.param], piece.offset, piece.tensor.numel(),
                          {key: v.detach().cpu() if isinstance(v, torch.Tensor) else v
                           for key, v in st.items()}))
        everyone: list[Any] = [None] * self.reducer.world_size
        dist.all_gather_object(everyone, local, group=self.reducer.group)
        by_param: dict[int, list] = {}
        for pieces in everyone:
            for j, offset, numel, st in pieces:
                by_param.setdefault(j, []).append((offset, numel, st))
        state = {j: _join(sorted(pieces, key=lambda x: x[0]), self._state_shape[j])
                 for j, pieces in sorted(by_param.items())}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(params)}
                  for g, params in zip(inner["param_groups"], self._group_params)]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full optimizer state (from ``state_dict()`` at any world size, or a torch optimizer)."""
        self.wait_for_params()
        groups = state_dict["param_groups"]
        if [list(g["params"]) for g in groups] != self._group_params:
            raise ValueError(
                "gradsync: the optimizer state's parameter groups "
                f"{[list(g['params']) for g in groups]} do not match this optimizer's "
                f"{self._group_params}; build the optimizer with the same param_groups (same parameters "
                "in the same order) as the one that saved the state"
            )
        full = state_dict["state"]
        state = {}
        for piece in self._pieces:
            st = full.get(self._state_index[piece.param])
            if st is None:
                continue
            numel = self.reducer.params[piece.param].numel()
            state[piece.index] = {
                key: v.reshape(-1)[piece.offset:piece.offset + piece.tensor.numel()].clone()
                if _per_element(key, v, numel) else v
                for key, v in st.items()}
        inner_groups, k = [], 0
        for g, current in zip(groups, self.optimizer.param_groups):
            n = len(current["params"])
            inner_groups.append({**g, "params": list(range(k, k + n))})
            k += n
        self.optimizer.load_state_dict({"state": state, "param_groups": inner_groups})
        self._link()


def _per_element(key: str, value: Any, numel: int) -> bool:
    # "step" is a scalar even when its parameter has one element (torch special-cases it too)
    return key != "step" and isinstance(value, torch.Tensor) and value.numel() == numel


def _join(pieces: list, shape: torch.Size) -> dict[str, Any]:
    total = shape.numel()
    covered = sum(numel for _, numel, _ in pieces)
    if covered != total or any(a[0] + a[1] != b[0] for a, b in zip(pieces, pieces[1:])):
        raise RuntimeError("gradsync: optimizer state pieces of a parameter do not tile it; ranks stepped "
                           "different parts of the model")
    out = {}
    for key, first in pieces[0][2].items():
        values = [st[key] for _, _, st in pieces]
        if all(_per_element(key, v, n) for v, (_, n, _) in zip(values, pieces)):
            out[key] = torch.cat([v.reshape(-1) for v in values]).view(shape)
        else:
            out[key] = first
    return out


__all__ = ["ShardedOptimizer"]
