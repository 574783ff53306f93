"""gradsync.replace_torch_ddp(): torch's DDP class builds gradsync wrappers, isinstance holds, undo is exact."""
import inspect

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.nn.parallel
import torch.nn.parallel.distributed
from torch.distributed.algorithms.join import Joinable
from torch.nn.parallel import DistributedDataParallel as BoundAtImport  # Lightning's import style

import gradsync
from gradsync.ddp import compat
from gradsync.engine.reducer import Reducer
from gradsync.tools.launch import run_ranks
from helpers import assert_close_dicts, batches, grads, mlp, shard

TorchDDP = torch.nn.parallel.distributed.DistributedDataParallel


def torch_class_state():
    return dict(vars(TorchDDP)), inspect.signature(TorchDDP)


def train_step(model, rank, world_size, step=0):
    x, y = batches(step + 1, world_size)[step]
    F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
    return grads(model.module)


def build_three_ways(rank, world_size):
    """Construct through every spelling frameworks use, inside the context manager."""
    out = {}
    with gradsync.replace_torch_ddp() as handle:
        assert handle.active and compat.is_torch_ddp_replaced()
        models = {
            "torch.nn.parallel": torch.nn.parallel.DistributedDataParallel(mlp(seed=rank)),
            "torch.nn.parallel.distributed": torch.nn.parallel.distributed.DistributedDataParallel(
                module=mlp(seed=rank), device_ids=None, output_device=None),  # Lightning's call
            "bound at import": BoundAtImport(mlp(seed=rank)),
        }
    assert not handle.active and not compat.is_torch_ddp_replaced()
    for how, model in models.items():
        out[how] = {
            "type": f"{type(model).__module__}.{type(model).__qualname__}",
            "gradsync": isinstance(model, gradsync.DistributedDataParallel),
            "torch": isinstance(model, torch.nn.parallel.DistributedDataParallel),
            "torch via import": isinstance(model, BoundAtImport),
            "joinable": isinstance(model, Joinable),
            "gradsync reducer": isinstance(model.reducer, Reducer),
            "keys": sorted(model.state_dict())[:2],
            # built by gradsync, so parameters start from rank 0's and gradients are averaged
            "grads": train_step(model, rank, world_size),
        }
    return out


def test_construction_through_torch_names_builds_gradsync():
    before = torch_class_state()
    results = run_ranks(build_three_ways, 2, timeout=60)
    assert torch_class_state() == before  # the parent was never touched (forked ranks)
    reference = mlp(seed=0)
    x, y = batches(1, 2)[0]
    F.mse_loss(reference(x), y).backward()
    expected = grads(reference)
    for rank_result in results:
        for how, r in rank_result.items():
            assert r["type"] == "gradsync.ddp.compat.DistributedDataParallel", how
            assert r["gradsync"] and r["torch"] and r["torch via import"] and r["joinable"], (how, r)
            assert r["gradsync reducer"], how
            assert r["keys"] == ["module.0.bias", "module.0.weight"], how
            assert_close_dicts(r["grads"], expected)


def attributes_and_no_sync(rank, world_size):
    handle = gradsync.replace_torch_ddp()  # the plain-call form
    try:
        model = torch.nn.parallel.DistributedDataParallel(mlp(seed=0))
    finally:
        handle.undo()
    # attribute lookup behaves as on gradsync's wrapper: torch-only helpers are absent, clearly
    absent = {}
    for name in ("_build_params_for_reducer", "_register_fused_optim"):  # torch-only internals
        try:
            getattr(model, name)
            absent[name] = "present"
        except AttributeError as exc:
            absent[name] = str(exc)
    # methods that exist on both resolve to gradsync's (or nn.Module's), never torch's
    resolved = {name: getattr(type(model), name).__qualname__
                for name in ("forward", "no_sync", "register_comm_hook", "train")}
    # broadcast_buffers is a property on torch's class: on the compat class it is gradsync's attribute
    model.broadcast_buffers = False
    model.broadcast_buffers = True
    with model.no_sync():
        local = train_step(model, rank, world_size)
    synced = train_step(model, rank, world_size, step=0)  # second micro-step, synced
    model.train(False)
    return absent, resolved, local, synced, model.training, model.broadcast_buffers


def test_instances_behave_like_gradsync():
    results = run_ranks(attributes_and_no_sync, 2, timeout=60)
    for rank, (absent, resolved, local, synced, training, bb) in enumerate(results):
        for name, message in absent.items():
            assert "belongs to torch's DistributedDataParallel" in message and name in message, message
        assert resolved["forward"].startswith("DistributedDataParallel.") and resolved["train"] == "Module.train"
        assert not training and bb is True
        # the no_sync micro-step stayed local; the synced one averaged both micro-steps
        x, y = batches(1, 2)[0]
        ref = mlp(seed=0)
        F.mse_loss(ref(shard(x, rank, 2)), shard(y, rank, 2)).backward()
        assert_close_dicts(local, grads(ref))
    assert_close_dicts(results[0][3], results[1][3])


def torch_after_undo(rank, world_size):
    with gradsync.replace_torch_ddp():
        with gradsync.replace_torch_ddp():  # nesting: only the outermost undo restores torch
            pass
        inner = torch.nn.parallel.DistributedDataParallel(mlp(seed=0))
    restored = torch.nn.parallel.DistributedDataParallel(mlp(seed=0))

    class Mine(TorchDDP):  # subclasses of torch's class are never redirected
        pass

    with gradsync.replace_torch_ddp():
        sub = Mine(mlp(seed=0))
    grads_torch = train_step(restored, rank, world_size)
    return (type(inner).__module__, type(restored) is TorchDDP, type(sub) is Mine,
            type(restored.reducer).__module__, grads_torch)


def test_no_torch_code_is_reachable_from_the_compat_class():
    """Every name torch's class defines resolves as on gradsync's class, for lookups and for super()."""
    compat_cls, facade = compat.DistributedDataParallel, compat._TorchFacade
    assert compat_cls.__mro__.index(facade) + 1 == compat_cls.__mro__.index(TorchDDP)
    machinery = compat._CLASS_MACHINERY
    names = set(vars(TorchDDP)) - machinery
    assert {"forward", "no_sync", "__init__", "__setstate__", "_get_ddp_logging_data"} <= names
    for name in names:
        torch_value = vars(TorchDDP)[name]
        assert vars(facade)[name] is not torch_value, name  # super() from gradsync never reaches torch
        mine = inspect.getattr_static(compat_cls, name)
        try:
            expected = inspect.getattr_static(gradsync.DistributedDataParallel, name)
        except AttributeError:  # torch-only: hidden
            assert isinstance(mine, compat._TorchOnly), name
        else:
            assert mine is expected, name
    assert not compat_cls.__abstractmethods__
    assert issubclass(compat_cls, TorchDDP) and issubclass(compat_cls, gradsync.DistributedDataParallel)


def test_undo_restores_torch_exactly():
    before = torch_class_state()
    handle = gradsync.replace_torch_ddp()
    assert vars(TorchDDP)["__init__"] is not before[0]["__init__"]
    assert inspect.signature(TorchDDP) == before[1]  # signature still torch's while active
    handle.undo()
    handle.undo()  # idempotent
    assert torch_class_state() == before  # the very same objects in torch's class dict
    assert torch.nn.parallel.DistributedDataParallel is TorchDDP is BoundAtImport
    with pytest.raises(ZeroDivisionError), gradsync.replace_torch_ddp():
        1 / 0  # an exception inside the block still undoes
    assert torch_class_state() == before

    for inner_module, is_torch, is_sub, reducer_module, torch_grads in run_ranks(torch_after_undo, 2, timeout=60):
        assert inner_module == "gradsync.ddp.compat"
        assert is_torch and is_sub and reducer_module.startswith("torch")
    x, y = batches(1, 2)[0]
    ref = mlp(seed=0)
    F.mse_loss(ref(x), y).backward()
    assert_close_dicts(torch_grads, grads(ref))
    assert not dist.is_initialized()


def one_line_swap(rank, world_size):
    """The one-line swap many scripts use: gradsync's class assigned over torch's name."""
    torch.nn.parallel.DistributedDataParallel = gradsync.DistributedDataParallel  # a forked rank: no undo needed
    model = torch.nn.parallel.DistributedDataParallel(mlp(seed=rank))
    return train_step(model, rank, world_size)


def test_one_line_class_swap_trains():
    # ddp/compile.py looked torch's class up through that name, so every forward raised
    # AttributeError: type object 'DistributedDataParallel' has no attribute '_active_ddp_module'
    results = run_ranks(one_line_swap, 2)
    assert_close_dicts(results[0], results[1], atol=0, rtol=0)
    assert torch.nn.parallel.DistributedDataParallel is TorchDDP  # the parent's name is untouched
