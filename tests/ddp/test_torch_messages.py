"""torch's own sentences in gradsync's errors, and the error torch's DDP logger keeps.

torch's DDP tests match these sentences (``test_c10d_common.py``'s comm-hook tests, distributed_test.py's
``test_invalid_static_graph``) and read the error back from ``_get_ddp_logging_data()``
(``has_error``, ``error``). Each case runs on both wrappers in one process group.
"""
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradsync
from helpers import run_ranks

WRAPPERS = {"torch": torch.nn.parallel.DistributedDataParallel, "gradsync": gradsync.DDP}


class ControlFlow(nn.Module):
    """torch's ControlFlowToyModel: ``lin2`` runs only on an input of ones."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin1 = nn.Linear(10, 10, bias=False)
        self.lin2 = nn.Linear(10, 10, bias=False)

    def forward(self, x):
        h = F.relu(self.lin1(x))
        return self.lin2(h) if torch.equal(x, torch.ones_like(x)) else h


def logged(model):
    data = model._get_ddp_logging_data()
    return data.get("has_error"), data.get("error")


def raises(fn, exc_type, pattern):
    """Run ``fn``; return the message of the ``exc_type`` it raised, matched by ``pattern`` as torch's tests do."""
    with pytest.raises(exc_type) as info:
        fn()
    assert re.search(pattern, str(info.value)), str(info.value)
    return str(info.value)


def hook_not_callable(cls):
    model = cls(nn.Linear(4, 4))
    before = logged(model)
    raises(lambda: model.register_comm_hook(state=None, hook=1), TypeError, "Communication hook must be callable.")
    return before, logged(model)


def hook_twice(cls):
    model = cls(nn.Linear(4, 4))

    def hook(state, bucket):
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut
    model.register_comm_hook(None, hook)
    raises(lambda: model.register_comm_hook(None, hook), RuntimeError,
           "register_comm_hook or register_builtin_comm_hook can only be called once.")
    return None, logged(model)


def static_graph_unused_then_used(cls):
    model = cls(ControlFlow(), static_graph=True)
    model(torch.randn(20, 10)).sum().backward()  # lin2 unused in the first iteration
    raises(lambda: model(torch.ones(20, 10)).sum().backward(), RuntimeError,
           "Your training graph has changed in this iteration")
    return None, logged(model)


# torch's test_invalid_static_graph matches this (raised around a backward and the next forward)
STATIC_GRAPH_UNUSED = ("Expected to have finished reduction in the prior iteration before starting a new one. This "
                       "error indicates that your training graph has changed in this iteration, e.g., one parameter "
                       "is used in first iteration, but then got unused in the second iteration. this is not "
                       "compatible with static_graph set to True.\nParameter indices which did not receive grad for")


def static_graph_used_then_unused(cls):
    model = cls(ControlFlow(), static_graph=True)
    model(torch.ones(20, 10)).sum().backward()  # lin2 used in the first iteration

    def iteration():
        model(torch.randn(20, 10)).sum().backward()
        model(torch.randn(20, 10))  # torch raises here, at the next forward; gradsync in the backward above
    raises(iteration, RuntimeError, STATIC_GRAPH_UNUSED)
    return None, logged(model)


def set_static_graph_late(cls):
    model = cls(nn.Linear(4, 4))
    model(torch.randn(2, 4)).sum().backward()
    raises(model._set_static_graph, RuntimeError, "should be called before training loop starts")
    return None, logged(model)


CASES = {
    hook_not_callable: "Communication hook must be callable.",
    hook_twice: "register_comm_hook or register_builtin_comm_hook can only be called once.",
    static_graph_unused_then_used: "Your training graph has changed in this iteration",
    static_graph_used_then_unused: "Expected to have finished reduction",
    set_static_graph_late: "should be called before training loop starts",
}


def both(rank, world_size):
    return {f"{case.__name__}/{name}": case(cls) for case in CASES for name, cls in WRAPPERS.items()}


def test_torchs_sentences_are_raised_and_logged_as_torch_does():
    for out in run_ranks(both, 2, timeout=90):
        for case, sentence in CASES.items():
            for name in WRAPPERS:
                before, (has_error, error) = out[f"{case.__name__}/{name}"]
                if before is not None:  # no error logged before the first one
                    assert before == (None, None), (case.__name__, name, before)
                assert has_error == 1, (case.__name__, name)
                assert sentence in error, (case.__name__, name, error)


def hook_returns_no_future(rank, world_size):
    """torch raises RuntimeError at the bucket's launch in the first backward, and does not log it."""
    out = {}
    for name, cls in WRAPPERS.items():
        model = cls(nn.Linear(4, 4))

        def hook(state, bucket):
            return 3
        model.register_comm_hook(None, hook)
        with pytest.raises(RuntimeError) as info:
            model(torch.randn(2, 4)).sum().backward()
        out[name] = str(info.value)
    return out


def test_a_hook_that_returns_no_future_raises_torchs_error():
    sentence = "DDP communication hook's callback must return a torch.futures.Future object, but got builtins.int"
    for out in run_ranks(hook_returns_no_future, 2, timeout=90):
        assert sentence in out["torch"], out["torch"]
        assert sentence in out["gradsync"], out["gradsync"]


def sync_batchnorm_on_cpu(rank, world_size):
    return [raises(lambda: cls(nn.Sequential(nn.Linear(4, 4), nn.SyncBatchNorm(4))), ValueError,
                   "SyncBatchNorm layers only work with GPU modules") for cls in WRAPPERS.values()]


def test_sync_batchnorm_on_cpu_is_refused_at_construction_as_torch_does():
    """gradsync wrapped it; torch's SyncBatchNorm then refused the CPU input at the first training forward."""
    run_ranks(sync_batchnorm_on_cpu, 2, timeout=90)
