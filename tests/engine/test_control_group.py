"""The control plane on a group of its own, as when the data plane is on a device (plane.control_group).

On a GPU the headers, the end-of-backward control and the carried item counts go over a CPU group,
so a steady-state step reads nothing back from the device. Here the data plane is on the CPU and
``SEPARATE_ON_CPU`` gives it the same split: the gradients must equal torch's DDP in the same
process group, and no tensor of the data plane (a bucket, a parameter, a gradient) may be read
back to the host by gradsync during a steady-state step.
"""
import contextlib
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import gradsync
from gradsync.engine import groups as plane_module
from gradsync.tools.launch import run_ranks
from helpers import Branches, Normed, assert_close_dicts, batches, grads, mlp, shard

TorchDDP = nn.parallel.DistributedDataParallel
READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")


def data_plane_spans(model) -> list[tuple[int, int]]:
    """The memory the data plane owns now: buckets, parameters, gradients."""
    tensors = [b.buffer for b in model.reducer.buckets] + list(model.parameters()) \
        + [p.grad for p in model.parameters() if p.grad is not None]
    return [(t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
            for t in tensors]


class Provenance(TorchDispatchMode):
    """Mark every tensor computed from the data plane's memory (or from a tensor so marked)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.derived = model, {}  # id -> weak reference (tensors do not hash by identity)

    def of_data_plane(self, t: torch.Tensor) -> bool:
        ref = self.derived.get(id(t))
        if ref is not None and ref() is t:
            return True
        return bool(t.numel()) and any(a <= t.data_ptr() < b for a, b in data_plane_spans(self.model))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(self.of_data_plane(t) for t in inputs):
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.derived[id(t)] = weakref.ref(t)
        return out


@contextlib.contextmanager
def data_plane_reads(model, log: list):
    """Record each read back to the host (the calls that sync on a device) of a tensor of the data
    plane or computed from one, while inside."""
    saved = {name: getattr(torch.Tensor, name) for name in READS}
    provenance = Provenance(model)

    def recorder(name, original):
        def read(self, *args, **kwargs):
            if provenance.of_data_plane(self):
                log.append(name)
            return original(self, *args, **kwargs)
        return read

    for name, original in saved.items():
        setattr(torch.Tensor, name, recorder(name, original))
    try:
        with provenance:
            yield log
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)


def steps_both(rank, world_size, make, kwargs, steps=4, micro=2, check_finite=False):
    """Train gradsync (own control group) and torch's DDP side by side; return both gradient
    histories and the data-plane reads gradsync made after its first two (warm-up) windows."""
    plane_module.SEPARATE_ON_CPU = True
    ours = gradsync.DDP(make(), check_finite=check_finite, **kwargs)
    plane_module.SEPARATE_ON_CPU = False
    theirs = TorchDDP(make(), **kwargs)
    assert ours.reducer.plane.group is not ours.process_group
    assert ours.reducer.plane.device == torch.device("cpu")
    history, reads = {"ours": [], "theirs": []}, []
    data = batches(steps * micro, world_size)
    for s in range(steps):
        for name, model in (("ours", ours), ("theirs", theirs)):
            with data_plane_reads(ours, reads) if name == "ours" and s >= 2 else contextlib.nullcontext():
                for k in range(micro):
                    x, y = data[s * micro + k]
                    ctx = model.no_sync() if k < micro - 1 else contextlib.nullcontext()
                    with ctx:
                        out = model(shard(x, rank, world_size))
                        F.mse_loss(out, shard(y, rank, world_size)[:, :out.shape[1]]).backward()
            history[name].append(grads(model.module))
            model.zero_grad(set_to_none=True)
    return history, reads


def test_own_control_group_matches_torch_and_reads_no_data_plane_tensor():
    cases = [(lambda: mlp(seed=0), {"bucket_cap_mb": 0.001}),  # several buckets
             (Normed, {}),  # a header before every forward's buffer broadcast
             (Branches, {"find_unused_parameters": True})]  # used counts in the control
    for make, kwargs in cases:
        for history, reads in run_ranks(steps_both, 2, make, kwargs):
            for ours, theirs in zip(history["ours"], history["theirs"]):
                assert_close_dicts(ours, theirs)
            assert reads == [], f"{make}: gradsync read data-plane tensors back: {reads}"


def test_the_read_detector_sees_a_data_plane_read():
    # check_finite reads every reduced bucket back (documented as a sync): the detector must see it
    for _, reads in run_ranks(steps_both, 2, lambda: mlp(seed=0), {}, 3, 1, True):
        assert "__bool__" in reads


def accumulate_items(rank, world_size):
    """The accumulator's item count rides in the header over the control group."""
    plane_module.SEPARATE_ON_CPU = True
    model = gradsync.DDP(mlp(seed=0))
    plane_module.SEPARATE_ON_CPU = False
    acc = gradsync.GradientAccumulator(model, steps=2)
    x, y = batches(1, world_size, per_rank=6)[0]
    xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
    n = 2 + 3 * rank  # rows this rank counts: 2 and 5
    for k in range(2):
        with acc.accumulate():
            acc.backward(F.mse_loss(model(xs[:n]), ys[:n], reduction="sum"), num_items=n)
    return grads(model.module)


def test_item_counts_ride_the_control_group():
    x, y = batches(1, 2, per_rank=6)[0]
    ref = mlp(seed=0)
    for _ in range(2):  # both micro-steps see the same rows: the window's mean is over 2 * (2 + 5)
        for r, n in ((0, 2), (1, 5)):
            (F.mse_loss(ref(shard(x, r, 2)[:n]), shard(y, r, 2)[:n], reduction="sum") / 14).backward()
    for got in run_ranks(accumulate_items, 2):
        assert_close_dicts(got, grads(ref))


def uneven_join(rank, world_size):
    plane_module.SEPARATE_ON_CPU = True
    ours = gradsync.DDP(mlp(seed=0), bucket_cap_mb=0.001)
    plane_module.SEPARATE_ON_CPU = False
    theirs = TorchDDP(mlp(seed=0), bucket_cap_mb=0.001)
    data = batches(3 + rank, world_size)  # rank 1 has one more batch
    out = []
    for model in (ours, theirs):
        with model.join():
            for x, y in data:
                F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
        out.append(grads(model.module))
    return out


def test_join_runs_its_handshakes_on_the_control_group():
    for ours, theirs in run_ranks(uneven_join, 2):
        assert_close_dicts(ours, theirs)


def two_wrappers_on_a_subgroup(rank, world_size):
    """Only the subgroup's members build its control group; wrappers over one group share it."""
    sub = dist.new_group([0, 1])  # every rank calls new_group; only 0 and 1 build wrappers
    if rank == 2:
        return None
    plane_module.SEPARATE_ON_CPU = True
    a = gradsync.DDP(mlp(seed=0), process_group=sub)
    b = gradsync.DDP(mlp(seed=1), process_group=sub)
    plane_module.SEPARATE_ON_CPU = False
    theirs = TorchDDP(mlp(seed=0), process_group=sub)
    x, y = batches(1, 2)[0]
    for model in (a, b, theirs):
        F.mse_loss(model(shard(x, rank, 2)), shard(y, rank, 2)).backward()
    assert a.reducer.plane.group is b.reducer.plane.group is not sub
    return grads(a.module), grads(theirs.module)


def test_wrappers_on_a_subgroup_share_its_control_group():
    results = run_ranks(two_wrappers_on_a_subgroup, 3)
    assert results[2] is None
    for ours, theirs in results[:2]:
        assert_close_dicts(ours, theirs)


def two_wrappers_on_world(rank, world_size):
    plane_module.SEPARATE_ON_CPU = True
    models = [gradsync.DDP(mlp(seed=s)) for s in range(2)]
    groups = len(dist.distributed_c10d._world.pg_map)
    for _ in range(5):  # a module wrapped again (each epoch, after unfreezing): no new group, no new sockets
        models[1] = gradsync.DDP(models[1].module)
    plane_module.SEPARATE_ON_CPU = False
    assert len(dist.distributed_c10d._world.pg_map) == groups
    assert models[0].reducer.plane.group is models[1].reducer.plane.group is not dist.group.WORLD
    x, y = batches(1, world_size)[0]
    for model in models:
        F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
    return [grads(m.module) for m in models]


def test_wrappers_on_the_world_group_share_one_control_group():
    a, b = run_ranks(two_wrappers_on_world, 2)
    for ga, gb in zip(a, b):
        assert_close_dicts(ga, gb)
