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
import itertools
import weakref
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..engine.errors import PeerFailure
from .wrapper import ShardedDataParallel
from .checkpoint import Checkpoints
from .comm import start_all_gather
from .regroup import claim_optimizer
from .prefetch import Gathers


class _Piece:
    __slots__ = ("index", "param", "offset", "tensor", "grad")

    def __init__(self, index: int, param: int, offset: int, tensor: torch.Tensor, grad: torch.Tensor):
        self.index, self.param, self.offset, self.tensor, self.grad = index, param, offset, tensor, grad


class _Side(NamedTuple):
    """One shard's pieces and the inner optimizer that steps them."""
    masters: list[torch.Tensor]
    pieces: list[_Piece]
    by_bucket: list[list[_Piece]]
    optimizer: torch.optim.Optimizer


class ShardedOptimizer(Checkpoints, torch.optim.Optimizer):
    """Run ``optimizer_class`` on this rank's shard of a ``ShardedDataParallel`` model.

    ``kwargs`` go to ``optimizer_class``. ``param_groups`` (optional) is a list of dicts like
    torch's, ``{"params": [model parameters], **options}``; by default all trainable
    parameters form one group. ``param_groups`` on the result are the inner optimizer's groups,
    so learning-rate schedulers work; their ``"params"`` hold the shard pieces.

    ``prefetch=True`` (opt-in) lets ``step()`` return before the parameter all-gathers finish:
    each bucket's is waited just before a torch function first uses memory of that bucket (a
    ``TorchFunctionMode`` checks the tensor arguments of every torch function until the end of the
    wrapper's next forward, a few microseconds per op), and everything is waited at the end of that forward,
    at the next ``step()`` and in ``state_dict()``/``load_state_dict()``. Memory read without a torch function
    (raw pointers, ``torch.distributed`` calls on parameters) needs ``wait_for_params()`` first. Under
    ``torch.compile`` everything is waited at forward entry.

    On an elastic model (``gradsync.elastic``) the store mirrors the shards (``regroup.py``): ``mirror`` then holds
    the next rank's shard, stepped alike (while the own shard's all-gather runs), and a re-shard rebuilds both sides
    (``lay_sides``); the all-gathers are waited in ``step()``, where a peer's failure is recovered.
    """

    sharded = True  # its state moves with the model's shards (a member that joins receives it as they re-shard)

    def __init__(self, model: ShardedDataParallel, optimizer_class: Callable[..., torch.optim.Optimizer],
                 *, param_groups: Iterable[dict] | None = None, prefetch: bool = False, **kwargs: Any):
        if not isinstance(model, ShardedDataParallel):
            raise TypeError(f"gradsync: ShardedOptimizer needs a gradsync.ShardedDataParallel model, got "
                            f"{type(model).__name__}; wrap the module in ShardedDataParallel first")
        if not isinstance(prefetch, bool):
            raise TypeError(f"gradsync: ShardedOptimizer's prefetch must be True or False, got "
                            f"{type(prefetch).__name__} {prefetch!r}")
        self.prefetch, self.model = prefetch, model
        self.reducer = reducer = model.reducer
        store = claim_optimizer(reducer.store, self)
        self._groups = groups = self._user_groups(param_groups)
        self._optimizer_class, self._kwargs = optimizer_class, kwargs
        # like torch: state is keyed by position in the concatenated groups' parameter lists
        order = [i for members, _ in groups for i in members]
        self._state_index = {i: k for k, i in enumerate(order)}
        self._state_shape = [reducer.params[i].shape for i in order]
        starts = [0, *itertools.accumulate(len(members) for members, _ in groups)]
        self._group_params = [list(range(a, b)) for a, b in zip(starts, starts[1:])]
        self.lay_sides()
        if any(m.dtype != p.dtype for m, p in zip(self._masters, (b.flat_param for b in reducer.buckets))):
            mine = weakref.ref(self)  # loading the model's weights restarts the master copies (checkpoint.py)
            model.module.register_load_state_dict_post_hook(
                lambda module, keys: None if (o := mine()) is None else o.refresh_masters())
        self._initializing = True
        super().__init__(self.optimizer.param_groups, self.optimizer.defaults)
        self._initializing = False
        self._link()
        if prefetch and store.gathers is None:
            store.gathers = Gathers(reducer)

    def lay_sides(self, flats: list[torch.Tensor] | None = None) -> None:
        """Build the pieces and inner optimizer of this rank's shard and, where the store mirrors shards, of the
        next rank's (``regroup.py``); ``flats``: each bucket's parameters, flat, in the masters' dtype."""
        store = self.reducer.store
        self.own = self._side(store.rank, "grad_shard", flats)
        self._masters, self._pieces, self._bucket_pieces, self.optimizer = self.own
        self.mirror = self._side(store.mirror_rank, "mirror_shard", flats) if store.mirrored else None

    def _side(self, shard: int, grads: str, flats: list[torch.Tensor] | None) -> tuple:
        reducer, store = self.reducer, self.reducer.store
        own, masters, pieces_of = shard == store.rank, [], {}
        for b in reducer.buckets:
            start, end = store.shard_range(b, shard)
            mine = b.flat_param[start:end]
            # the bucket's own memory where it is wide enough; an fp32 copy (or the mirror's copy) otherwise
            master = mine if own and mine.dtype == b.grad_shard.dtype else (
                mine if flats is None else flats[b.index][start:end]).to(b.grad_shard.dtype, copy=True)
            masters.append(master)
            grad = getattr(b, grads)
            for i, off in zip(b.members, b.offsets):
                lo, hi = max(off, start), min(off + reducer.params[i].numel(), end)
                if lo < hi:
                    pieces_of[i] = _Piece(-1, i, lo - off, master[lo - start:hi - start], grad[lo - start:hi - start])
        pieces, inner_groups = [], []
        for members, options in self._groups:
            for piece in (mine := [pieces_of[i] for i in members if i in pieces_of]):
                piece.index = len(pieces)
                pieces.append(piece)
            inner_groups.append({**options, "params": [piece.tensor for piece in mine]})
        by_bucket: list[list[_Piece]] = [[] for _ in reducer.buckets]
        for piece in pieces:
            by_bucket[store.bucket_of[piece.param]].append(piece)
        return _Side(masters, pieces, by_bucket, self._optimizer_class(inner_groups, **self._kwargs))

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
        if self.mirror is not None:  # the next rank's shard, stepped alike: kept should that rank leave
            for group, theirs in zip(self.optimizer.param_groups, self.mirror.optimizer.param_groups):
                theirs.update((k, v) for k, v in group.items() if k != "params")  # a scheduler edits ours
        for piece in self._pieces + (self.mirror.pieces if self.mirror is not None else []):
            piece.tensor.grad = None
        # bucket by bucket (the optimizer is element-wise): each bucket's all-gather runs while the next one steps
        works: dict[int, list] = {}
        failure = None  # with a commit protocol: a peer left during the all-gathers; every shard steps anyway
        for b, master in zip(reducer.buckets, self._masters):
            self._step_bucket(self.own, b)
            start, end = store.shard_range(b)
            own = b.flat_param[start:end]
            if master is not own:
                own.copy_(master)
            if reducer.world_size > 1 and failure is None:
                try:
                    works[b.index] = start_all_gather(b.flat_param, b.shard_numel, reducer.rank, reducer.group,
                                                      reducer.launcher.exchange)
                except (RuntimeError, dist.DistError) as exc:
                    failure = self._lost(exc)
            if self.mirror is not None:  # its own copy of the next rank's shard: stepped while this all-gather runs
                self._step_bucket(self.mirror, b)
        for piece in self._pieces:
            piece.tensor.grad = piece.grad if store.has_grad[piece.param] else None
        if failure is None and not (self.prefetch and reducer.attached is None and store.gathers.defer(works)):
            try:
                for index, bucket_works in works.items():
                    for work in bucket_works:
                        reducer.wait(work, f"the parameter all-gather of bucket {index}")
            except (RuntimeError, dist.DistError) as exc:
                failure = self._lost(exc)
        if failure is None and reducer.attached is not None and not reducer.attached.agree("step"):
            failure = PeerFailure("gradsync: a member did not finish the optimizer step's all-gathers")
        if failure is not None:  # the survivors re-form and re-shard: every parameter comes from its holder
            reducer.attached.recover(failure)
        return loss

    def _step_bucket(self, side: _Side, b: Any) -> None:
        stepped = [piece for piece in side.by_bucket[b.index] if self.reducer.store.has_grad[piece.param]]
        for piece in stepped:
            piece.tensor.grad = piece.grad
        if stepped:
            side.optimizer.step()
        for piece in stepped:
            piece.tensor.grad = None

    def _lost(self, exc: BaseException) -> BaseException:
        """A failed all-gather: re-raised without a commit protocol, else recovered once every shard stepped."""
        if self.reducer.attached is None:
            raise exc
        return exc


__all__ = ["ShardedOptimizer"]
