"""The wrapper against torch 2.13's DDP: constructor keywords, pickling, functional_call, comm-hook
checks, buffer sync flags, bucket caps, re-wrapping a module (torch's distributed_test.py cases)."""
import copy
import gc
import inspect
import io
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gradsync
from gradsync import GradBucket
from gradsync.tools.launch import run_ranks
from helpers import assert_close_dicts, batches, grads, mlp, params, shard

TorchDDP = nn.parallel.DistributedDataParallel


def step(model, rank, world_size, k=0):
    x, y = batches(k + 1, world_size)[k]
    F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()


def test_constructor_takes_torchs_arguments_in_torchs_order():
    ours = inspect.signature(gradsync.DDP.__init__).parameters
    theirs = inspect.signature(TorchDDP.__init__).parameters
    assert list(ours)[:len(theirs)] == list(theirs)
    for name, p in theirs.items():
        assert (ours[name].kind, ours[name].default) == (p.kind, p.default), name
    assert all(p.kind is p.KEYWORD_ONLY for p in list(ours.values())[len(theirs):])


# ---------------------------------------------------------------- item 4: pickling
def save_and_load(rank, world_size):
    model = gradsync.DDP(mlp(seed=rank), bucket_cap_mb=0.001)
    theirs = TorchDDP(mlp(seed=rank), bucket_cap_mb=0.001)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step(model, rank, world_size)
    opt.step()
    buf = io.BytesIO()
    torch.save(model, buf)  # torch's test_DistributedDataParallelCPU saves mid-training
    torch.save(theirs, io.BytesIO())
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    same_state = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    twin = copy.deepcopy(loaded)
    for m in (loaded, twin):
        m.zero_grad()
        step(m, rank, world_size, k=1)
    other = dist.new_group(list(range(world_size)))
    with pytest.raises(RuntimeError, match="default process group"):
        torch.save(gradsync.DDP(mlp(seed=rank), process_group=other), io.BytesIO())
    return same_state, type(loaded).__name__, grads(loaded.module), grads(twin.module)


def test_pickled_wrapper_loads_on_the_default_group_and_keeps_training():
    results = run_ranks(save_and_load, 2)
    for same_state, kind, loaded, twin in results:
        assert same_state and kind == "DistributedDataParallel"
        assert_close_dicts(loaded, twin)
    assert_close_dicts(results[0][2], results[1][2])  # the loaded copies synchronize


def with_batchnorm_and_delayed(path=None):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8, momentum=0.0), nn.Linear(8, 2))  # momentum 0: the forward's stats
    model = gradsync.DDP(net, delay_all_reduce_named_params=[("2.weight", net[2].weight)], param_to_hook_all_reduce=net[0].weight)
    if path is not None:
        torch.save(model, path)
    return model


def save_one(rank, world_size, path):
    with_batchnorm_and_delayed(path)


def load_on_a_larger_group(rank, world_size, path):
    """Train one forward and backward of the loaded wrapper and of the same one built on this group."""
    out = []
    for model in (torch.load(path, weights_only=False), with_batchnorm_and_delayed()):
        model.module[1].running_mean.fill_(float(rank))  # the ranks' buffers differ: the forward broadcasts rank 0's
        torch.manual_seed(rank)
        model(torch.randn(6, 4)).square().mean().backward()
        out.append((model.world_size, {**grads(model.module), "mean": model.module[1].running_mean.clone()}))
    return out


def test_a_wrapper_saved_on_one_rank_loads_on_two_with_their_world_size(tmp_path):
    """It kept the world size it was saved with: buffers never broadcast, the delayed gradient divided by 1."""
    path = str(tmp_path / "model.pt")
    run_ranks(save_one, 1, path)
    for (size, loaded), (_, fresh) in run_ranks(load_on_a_larger_group, 2, path):
        assert size == 2
        assert_close_dicts(loaded, fresh)


# ---------------------------------------------------------------- item 6: functional_call
class WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(1, 1)
        self.register_buffer("buffer", torch.ones(1))

    def forward(self, x):
        return self.l1(x) + self.buffer


def functional(rank, world_size, cls):
    torch.manual_seed(0)
    model = cls(WithBuffer())
    x = torch.rand(1, 1) + rank
    weight = torch.tensor([[1.0]], requires_grad=True)
    bias = torch.tensor([0.0], requires_grad=True)
    substitutes = {"module.l1.weight": weight, "module.l1.bias": bias, "module.buffer": torch.zeros(1)}
    before = params(model.module)
    res = torch.func.functional_call(model, substitutes, x)
    res.backward()
    untouched = all(torch.equal(before[n], p) for n, p in model.module.named_parameters())
    module_grads = [p.grad for p in model.module.parameters()]
    out = model(torch.ones(2, 1) * (rank + 1)).sum()  # an ordinary step afterwards synchronizes
    out.backward()
    return res.detach(), weight.grad, bias.grad, untouched, module_grads, grads(model.module)


def test_functional_call_runs_on_substituted_tensors_like_torch():
    ours = run_ranks(functional, 2, gradsync.DDP)
    theirs = run_ranks(functional, 2, TorchDDP)
    for rank in range(2):
        res, wg, bg, untouched, module_grads, after = ours[rank]
        assert torch.equal(res, theirs[rank][0]) and untouched and module_grads == [None, None]
        # the substituted tensors are not the wrapper's parameters: their gradients stay local
        assert torch.equal(wg, theirs[rank][1]) and torch.equal(bg, theirs[rank][2])
        assert_close_dicts(after, theirs[rank][5])
    assert not torch.equal(ours[0][1], ours[1][1])


# ---------------------------------------------------------------- item 7: constructor keywords
def keywords(rank, world_size):
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for kwargs in ({}, {"broadcast_buffers": True}, {"broadcast_buffers": False},
                       {"forward_sync_buffers": False}, {"broadcast_buffers": False, "forward_sync_buffers": True},
                       {"check_reduction": True}):
            caught.clear()
            model = gradsync.DDP(mlp(seed=0), **kwargs)
            out[str(kwargs)] = ([str(w.message) for w in caught if w.category is FutureWarning],
                                model.broadcast_buffers, model.forward_sync_buffers)
            del model
    # init_sync=False: no verification, no broadcast (torch: the user keeps weights equal)
    unsynced = gradsync.DDP(mlp(seed=rank), init_sync=False)
    out["init_sync=False differs"] = not torch.equal(unsynced.module[0].weight, mlp(seed=0)[0].weight) or rank == 0
    # positional, as torch allows
    positional = gradsync.DDP(mlp(seed=rank), None, None, 0, None, True, None, 0.001)
    out["positional buckets"] = len(positional.reducer.buckets)
    with pytest.raises(NotImplementedError, match="mixed_precision"):
        gradsync.DDP(mlp(), mixed_precision=object())
    with pytest.raises(ValueError, match="set at the same time"):
        gradsync.DDP(mlp(), delay_all_reduce_named_params=[])
    # accepted knobs with nothing to change here (every parameter used): same gradients
    knobs = gradsync.DDP(mlp(seed=rank), batched_grad_copy=True, skip_all_reduce_unused_params=True,
                         find_unused_parameters=True)
    step(knobs, rank, world_size)
    out["knobs"] = grads(knobs.module)
    return out


def test_constructor_keywords_have_torchs_meaning():
    for rank, out in enumerate(run_ranks(keywords, 2)):
        assert out["{}"] == ([], True, True)
        assert "deprecated" in out["{'broadcast_buffers': True}"][0][0]
        assert out["{'broadcast_buffers': False}"][1:] == (False, False)
        assert out["{'forward_sync_buffers': False}"] == ([], False, False)
        mixed = out["{'broadcast_buffers': False, 'forward_sync_buffers': True}"]
        assert "ignored" in mixed[0][0] and mixed[1:] == (True, True)
        assert "check_reduction" in out["{'check_reduction': True}"][0][0]
        assert out["init_sync=False differs"]
        assert out["positional buckets"] > 1
        ref = mlp(seed=0)
        x, y = batches(1, 2)[0]
        F.mse_loss(ref(x), y).backward()
        assert_close_dicts(out["knobs"], grads(ref))


def meshes(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,))
    model = gradsync.DDP(mlp(seed=rank), device_mesh=mesh)
    step(model, rank, world_size)
    with pytest.raises(RuntimeError, match="Cannot specify both process_group and device_mesh"):
        gradsync.DDP(mlp(), process_group=dist.group.WORLD, device_mesh=mesh)
    two_d = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(RuntimeError, match="Only 1D device mesh is supported"):
        gradsync.DDP(mlp(), device_mesh=two_d)
    dp = gradsync.DDP(mlp(seed=0), device_mesh=two_d["dp"])  # a slice: reduce over its group only
    step(dp, rank // 2, 2)
    return model.device_mesh is mesh, grads(model.module), dist.get_process_group_ranks(dp.process_group)


def test_device_mesh_gives_the_process_group():
    results = run_ranks(meshes, 4, timeout=90)
    for rank, (kept, got, dp_ranks) in enumerate(results):
        assert kept and dp_ranks == ([0, 2] if rank % 2 == 0 else [1, 3])
        assert_close_dicts(got, results[0][1])


def delayed(rank, world_size):
    model = mlp(seed=0)
    named = dict(model.named_parameters())
    ddp = gradsync.DDP(model, delay_all_reduce_named_params=[("2.weight", named["2.weight"]),
                                                             ("2.bias", named["2.bias"])],
                       param_to_hook_all_reduce=named["0.weight"])
    with ddp.no_sync():
        step(ddp, rank, world_size)
    local = grads(ddp.module)
    step(ddp, rank, world_size)
    theirs = nn.parallel.DistributedDataParallel(
        mlp(seed=0), delay_all_reduce_named_params=[("2.weight", named["2.weight"]), ("2.bias", named["2.bias"])],
        param_to_hook_all_reduce=named["0.weight"])
    assert list(ddp.state_dict()) == list(theirs.state_dict())  # the hook parameter is not the wrapper's own
    assert [n for n, _ in ddp.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    return local, grads(ddp.module), [p.numel() for p in ddp.reducer.params]


def test_delayed_all_reduce_parameters_are_averaged_apart_from_the_buckets():
    results = run_ranks(delayed, 2)
    ref = mlp(seed=0)
    x, y = batches(1, 2)[0]
    F.mse_loss(ref(x), y).backward()
    F.mse_loss(ref(x), y).backward()
    for local, synced, reduced in results:
        assert sum(reduced) == sum(p.numel() for p in mlp().parameters()) - 32 * 32 - 32
        assert_close_dicts(synced, grads(ref))
    assert not torch.equal(results[0][0]["2.weight"], results[1][0]["2.weight"])  # no_sync: local


def delayed_by_object(rank, world_size):
    inner = mlp(seed=0)
    outer = nn.Sequential(inner)  # as a module compiled before wrapping, whose names gain "_orig_mod."
    ddp = gradsync.DDP(outer, delay_all_reduce_named_params=[("2.weight", inner[2].weight)],
                       param_to_hook_all_reduce=inner[0].weight)
    step(ddp, rank, world_size)
    with pytest.raises(ValueError, match="'stray', a tensor that is not a trainable parameter"):
        gradsync.DDP(mlp(seed=0), delay_all_reduce_named_params=[("stray", nn.Parameter(torch.zeros(2)))],
                     param_to_hook_all_reduce=inner[0].weight)
    return ddp.delayed_names, grads(inner)


def test_delayed_parameters_are_matched_by_object_as_torch_does():
    """Names of the unwrapped module (or misspelt ones) were a bare KeyError at construction."""
    ref = mlp(seed=0)
    x, y = batches(1, 2)[0]
    F.mse_loss(ref(x), y).backward()
    for names, synced in run_ranks(delayed_by_object, 2):
        assert names == ["0.2.weight"]
        assert_close_dicts(synced, grads(ref))


# ---------------------------------------------------------------- item 8: buffers and init sync
class RankLocal(nn.Module):
    def __init__(self, rank):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(10, 10, bias=False)
        self.register_buffer("local", torch.full((10,), float(rank)))

    def forward(self, x):
        return self.fc(x) + self.local


def buffer_flags(rank, world_size, cls, kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = cls(RankLocal(rank), **kwargs)
    at_init = model.module.local.clone()
    if rank == 0:
        model.module.local += 10
    model(torch.ones(2, 10)).sum().backward()
    after_forward = model.module.local.clone()
    with model.join():
        for _ in range(rank + 1):
            model(torch.ones(2, 10)).sum().backward()
    return at_init, after_forward, model.module.local.clone()


@pytest.mark.parametrize("kwargs", [{}, {"broadcast_buffers": False}, {"forward_sync_buffers": False}],
                         ids=["default", "broadcast_buffers_false", "forward_sync_buffers_false"])
def test_buffer_sync_flags_match_torch(kwargs):
    ours = run_ranks(buffer_flags, 2, gradsync.DDP, kwargs)
    theirs = run_ranks(buffer_flags, 2, TorchDDP, kwargs)
    for rank in range(2):
        for got, want in zip(ours[rank], theirs[rank]):
            assert torch.equal(got, want), (rank, got, want)
    if kwargs:  # rank-local buffers survive the join (torch's test_ddp_join_respects_forward_sync_buffers_false)
        assert not torch.equal(ours[0][2], ours[1][2])


def forward_param_sync(rank, world_size):
    model = gradsync.DDP(RankLocal(rank))
    assert model.require_forward_param_sync is True
    model.require_forward_param_sync = False  # torch: no buffer sync in the next forwards
    if rank == 0:
        model.module.local += 10
    model(torch.ones(2, 10)).sum().backward()
    return model.module.local.clone()


def test_require_forward_param_sync_gates_the_buffer_sync():
    a, b = run_ranks(forward_param_sync, 2)
    assert torch.equal(a, torch.full((10,), 10.0)) and torch.equal(b, torch.zeros(10))  # rank 0's at init


# ---------------------------------------------------------------- item 10: comm-hook checks
def bad_bucket(state, bucket: int) -> torch.futures.Future[torch.Tensor]:
    raise AssertionError("never called")


def bad_return(state, bucket: dist.GradBucket) -> int:
    raise AssertionError("never called")


def plain(state, bucket):
    return gradsync.allreduce_hook(state, bucket)


def ours_annotated(state, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    return gradsync.allreduce_hook(state, bucket)


def hook_checks(rank, world_size):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    out = {}
    for cls in (gradsync.DDP, TorchDDP):
        for hook in (bad_bucket, bad_return):
            with pytest.raises(ValueError, match="annotation should be") as info:
                cls(mlp()).register_comm_hook(None, hook)
            out[(cls.__name__ + str(cls.__module__), hook.__name__)] = str(info.value)
    for hook in (plain, ours_annotated, gradsync.allreduce_hook, default_hooks.allreduce_hook):
        gradsync.DDP(mlp()).register_comm_hook(None, hook)
    return out


def test_comm_hook_annotations_are_checked_like_torch():
    for out in run_ranks(hook_checks, 2):
        for (_, hook), message in out.items():
            assert ("bucket annotation" if hook == "bad_bucket" else "return annotation") in message


# ---------------------------------------------------------------- item 12: bucket caps
def bucket_sizes(rank, world_size, kwargs):
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])  # 16 KiB per layer
    ours = gradsync.DDP(copy.deepcopy(model), **kwargs)
    theirs = TorchDDP(copy.deepcopy(model), **kwargs)
    for _ in range(2):  # both re-plan after the first iteration
        for m in (ours, theirs):
            m(torch.randn(2, 64)).sum().backward()
    return ([sum(ours.reducer.params[i].numel() for i in b) for b in ours.reducer.bucket_plan()],
            [b.buffer().numel() for b in theirs.reducer._get_zeros_like_grad_buckets()])


@pytest.mark.parametrize("kwargs", [{"bucket_cap_mb": 0.01}, {"bucket_cap_mb": 0.02}, {},
                                    {"bucket_cap_mb_list": [0.005, 0.01]}],
                         ids=["cap_0.01", "cap_0.02", "default", "cap_list"])
def test_bucket_sizes_follow_torchs_caps(kwargs):
    ours, theirs = run_ranks(bucket_sizes, 2, kwargs)[0]
    assert ours == theirs
    if kwargs.get("bucket_cap_mb") == 0.01:
        assert len(ours) >= 5  # an explicit cap caps the first bucket too


# ---------------------------------------------------------------- item 13: device_ids
def device_ids(rank, world_size):
    messages = []
    for cls in (gradsync.DDP, TorchDDP):
        for kwargs in ({"device_ids": [0]}, {"output_device": 1}, {"device_ids": [0, 1]}):
            with pytest.raises(ValueError, match="device_ids") as info:
                cls(mlp(), **kwargs)
            messages.append(str(info.value))
    gradsync.DDP(mlp(), device_ids=None, output_device=None)
    gradsync.DDP(mlp(), device_ids=[])
    return messages


def test_device_ids_with_a_cpu_module_raise_like_torch():
    ours_and_theirs = run_ranks(device_ids, 1)[0]
    assert "CPU modules" in ours_and_theirs[0] and "single element" in ours_and_theirs[2]


# ---------------------------------------------------------------- item 5: wrapping again
def rewrap(rank, world_size):
    module = mlp(seed=rank)
    for find_unused, static_graph in [(True, False), (False, True), (False, False)]:
        ddp = gradsync.DDP(module, find_unused_parameters=find_unused, static_graph=static_graph)
        for _ in range(2):
            step(ddp, rank, world_size)
        newer = gradsync.DDP(module)  # while the first wrapper lives, as torch's tests loop over DDP(model)
        with pytest.raises(RuntimeError, match="wrapped again by a newer"):
            ddp(torch.randn(2, 8))  # the first one no longer synchronizes and says so
        step(newer, rank, world_size)
        shallow = copy.copy(newer)  # shares the module: the copy's reducer takes the parameters over
        with pytest.raises(RuntimeError, match="copy.copy shares the module"):
            newer(torch.randn(2, 8))
        step(shallow, rank, world_size)
        del ddp, newer, shallow
        gc.collect()
    module.zero_grad()
    step(module, rank, world_size)  # no wrapper left: a plain local backward
    local = grads(module)
    return local


def test_a_module_can_be_wrapped_again_once_its_wrapper_is_gone():
    results = run_ranks(rewrap, 2)
    assert not torch.equal(results[0]["0.weight"], results[1]["0.weight"])
    with pytest.raises(Exception, match="already wrapped"):
        run_ranks(lambda r, w: gradsync.DDP(gradsync.DDP(mlp())), 1)


def set_static_graph_late(rank, world_size):
    model = gradsync.DDP(mlp(seed=rank))
    model._set_static_graph()  # torch's private switch, before the first backward
    for k in range(2):
        step(model, rank, world_size, k)
    learned = model.reducer.expected.static_counts is not None
    with pytest.raises(RuntimeError, match="before training loop starts"):
        model._set_static_graph()
    return model.static_graph, learned, model._get_ddp_logging_data()["static_graph"]


def test_static_graph_can_be_set_before_the_first_backward():
    assert run_ranks(set_static_graph_late, 2) == [(True, True, 1)] * 2
