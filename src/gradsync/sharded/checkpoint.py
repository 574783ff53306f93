"""``ShardedOptimizer``'s checkpoints: the full state in torch's per-parameter format, and the master weights.

``state_dict()`` gathers every rank's pieces into torch's format (keyed by position in the concatenated
groups' parameter lists), so a checkpoint moves between world sizes and to and from torch optimizers with
the same groups. With low-precision parameters the inner optimizer steps fp32 master copies of the shard
(``optim.py``): the state carries them too, per element, under ``MASTER``, since the parameters are only
their rounding; a state without them (torch's optimizer, a plain parameter load) starts them from the
parameters. A ``load_state_dict`` on the model does the same (a post-hook), else the next step would copy
the stale masters over the weights just loaded.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

MASTER = "gradsync_master"  # the fp32 master weights of a low-precision parameter, in its optimizer state


class Checkpoints:
    """The checkpoint half of ``ShardedOptimizer`` (its attributes: ``optim.py``)."""

    def state_dict(self) -> dict[str, Any]:
        """Return the full (unsharded) optimizer state in torch's format; collective: call on every rank."""
        self.wait_for_params()
        everyone: list[Any] = [None] * self.reducer.world_size
        dist.all_gather_object(everyone, self.pieces_state(), group=self.reducer.group)
        return self.full_state([piece for pieces in everyone for piece in pieces])

    def pieces_state(self, mirror: bool = False) -> list[tuple]:
        """(state index, offset in the parameter, elements, state on the CPU) of each piece of this rank's shard,
        or of the shard it mirrors; a low-precision parameter's piece also carries its master weights."""
        optimizer, pieces = (self.mirror.optimizer, self.mirror.pieces) if mirror else (self.optimizer, self._pieces)
        states, out = optimizer.state_dict()["state"], []
        for k, piece in enumerate(pieces):
            st = {key: v.detach().cpu() if isinstance(v, torch.Tensor) else v for key, v in states.get(k, {}).items()}
            if piece.tensor.dtype != self.reducer.params[piece.param].dtype:
                st[MASTER] = piece.tensor.detach().cpu().clone()
            if st:
                out.append((self._state_index[piece.param], piece.offset, piece.tensor.numel(), st))
        return out

    def full_state(self, pieces: list[tuple]) -> dict[str, Any]:
        """torch's per-parameter state from pieces that tile the parameters, with this rank's group options."""
        by_param: dict[int, list] = {}
        for j, offset, numel, st in pieces:
            by_param.setdefault(j, []).append((offset, numel, st))
        state = {j: _join(sorted(pieces, key=lambda x: x[0]), self._state_shape[j])
                 for j, pieces in sorted(by_param.items())}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(params)}
                  for g, params in zip(self.optimizer.param_groups, self._group_params)]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full optimizer state (from ``state_dict()`` at any world size, or a torch optimizer)."""
        self.wait_for_params()
        groups = state_dict["param_groups"]
        if [list(g["params"]) for g in groups] != self._group_params:
            raise ValueError(
                f"gradsync: the optimizer state's parameter groups {[list(g['params']) for g in groups]} do not match "
                f"this optimizer's {self._group_params}; build the optimizer with the same param_groups (same "
                "parameters in the same order) as the one that saved the state")
        self.refresh_masters()  # from the parameters, where the state holds none
        mirrored = [(self.mirror.optimizer, self.mirror.pieces)] if self.mirror is not None else []
        for optimizer, pieces in [(self.optimizer, self._pieces)] + mirrored:
            state = {}
            for piece in pieces:
                st = dict(state_dict["state"].get(self._state_index[piece.param], {}))
                shape = self.reducer.params[piece.param].shape
                master = st.pop(MASTER, None)
                if master is not None and piece.tensor.dtype != self.reducer.params[piece.param].dtype:
                    piece.tensor.copy_(master.reshape(-1)[piece.offset:piece.offset + piece.tensor.numel()])
                if not st:
                    continue
                state[piece.index] = {  # a tensor each: AdamW counts its step in place, and a parameter may
                    # have a piece in this rank's shard and one in the shard it mirrors
                    key: v.reshape(-1)[piece.offset:piece.offset + piece.tensor.numel()].clone()
                    if _per_element(key, v, shape) else v.clone() if isinstance(v, torch.Tensor) else v
                    for key, v in st.items()}
            inner_groups, k = [], 0
            for g, current in zip(groups, optimizer.param_groups):
                n = len(current["params"])
                inner_groups.append({**g, "params": list(range(k, k + n))})
                k += n
            optimizer.load_state_dict({"state": state, "param_groups": inner_groups})
        self._link()

    def refresh_masters(self) -> None:
        """Start every master copy (low-precision parameters) from the parameters as they are now."""
        store = self.reducer.store
        sides = [(self.own, store.rank)] + ([(self.mirror, store.mirror_rank)] if self.mirror is not None else [])
        for side, shard in sides:
            for b, master in zip(self.reducer.buckets, side.masters):
                start, end = store.shard_range(b, shard)
                mine = b.flat_param[start:end]
                if master.data_ptr() != mine.data_ptr():
                    master.copy_(mine)


def _per_element(key: str, value: Any, shape: tuple[int, ...]) -> bool:
    # by shape, not size: a 1-element piece's scalar state (NAdam's mu_product, ASGD's eta) is 0-dim, its
    # per-element state 1-D; "step" is a scalar even for a 0-dim parameter (torch special-cases it too)
    return key != "step" and isinstance(value, torch.Tensor) and value.shape == shape


def _join(pieces: list, shape: torch.Size) -> dict[str, Any]:
    total = shape.numel()
    covered = sum(numel for _, numel, _ in pieces)
    if covered != total or any(a[0] + a[1] != b[0] for a, b in zip(pieces, pieces[1:])):
        raise RuntimeError("gradsync: optimizer state pieces of a parameter do not tile it; ranks stepped "
                           "different parts of the model")
    out = {}
    for key, first in pieces[0][2].items():
        values = [st[key] for _, _, st in pieces]
        if all(_per_element(key, v, (n,)) for v, (_, n, _) in zip(values, pieces)):
            out[key] = torch.cat([v.reshape(-1) for v in values]).view(shape)
        else:
            out[key] = first
    return out


__all__ = ["MASTER", "Checkpoints"]
