"""Bad input: non-finite gradients, broken comm hooks, wrong-dtype gradients."""
import pytest
import torch
import torch.distributed as dist

import gradsync
from gradsync.tools.launch import run_ranks
from helpers import SLACK, TIMEOUT, batches, faults, grads, mlp, outcome, shard_backward


def non_finite(rank, world_size, check, value):
    model = gradsync.DDP(mlp(), timeout=TIMEOUT, check_finite=check)
    if rank == 1:  # one parameter's local gradient goes bad on one rank
        model.module[2].weight.register_hook(lambda g: g * value)
    x, y = batches(1, world_size)[0]
    result = outcome(lambda: shard_backward(model, rank, world_size, x, y))
    return result, grads(model.module)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_check_finite_names_the_parameter_on_every_rank(value):
    for rank, ((kind, message, seconds), local) in enumerate(faults(non_finite, True, value)):
        assert kind == "FloatingPointError", message
        assert "2.weight" in message and "1 parameter(s)" in message
        assert "0.weight" not in message and "2.bias" not in message
        # nothing was written back: .grad holds the rank's own (unsynchronized) gradient
        assert torch.isfinite(local["2.weight"]).all() == (rank == 0)


def test_without_check_finite_nan_propagates_to_every_rank():
    for (kind, message, _), got in faults(non_finite, False, float("nan")):
        assert kind == "ok", message
        assert torch.isnan(got["2.weight"]).all() and torch.isfinite(got["2.bias"]).all()


def raising_hook(rank, world_size, where):
    model = gradsync.DDP(mlp(), timeout=TIMEOUT)

    def hook(state, bucket):
        if rank == 1 and where == "call":
            raise ValueError("hook exploded")
        fut = gradsync.allreduce_hook(None, bucket)
        if rank == 1 and where == "future":
            def fail(f):
                raise ValueError("hook exploded")
            return fut.then(fail)
        return fut

    model.register_comm_hook(None, hook)
    x, y = batches(1, world_size)[0]
    return outcome(lambda: shard_backward(model, rank, world_size, x, y))


@pytest.mark.parametrize("where", ["call", "future"])
def test_comm_hook_that_raises(where):
    (kind0, message0, seconds0), (kind1, message1, _) = faults(raising_hook, where)
    assert "hook exploded" in message1, message1
    assert kind1 == ("SyncError" if where == "future" else "ValueError")
    if where == "future":  # its own future's error, not a timeout blamed on the others
        assert "and it failed: " in message1 and "did not finish" not in message1, message1
    # rank 0 waits (bounded) for collectives rank 1 never finishes
    assert kind0 == "SyncError" and "waited for" in message0, message0
    assert seconds0 < TIMEOUT + SLACK
    print(f"\n[measured] comm hook raised on the peer ({where}): {seconds0:.2f}s")


def wrong_dtype_hook(rank, world_size):
    model = gradsync.DDP(mlp(), timeout=TIMEOUT)
    model.register_comm_hook(None, lambda state, bucket: gradsync.allreduce_hook(None, bucket).then(
        lambda f: f.value().double()))
    x, y = batches(1, world_size)[0]
    return outcome(lambda: shard_backward(model, rank, world_size, x, y))


def test_comm_hook_returning_the_wrong_dtype():
    for kind, message, _ in faults(wrong_dtype_hook):
        assert kind == "TypeError" and "torch.float64" in message and "torch.float32" in message, message


def wrong_dtype_grad(rank, world_size, allow):
    model = gradsync.DDP(mlp(), timeout=TIMEOUT)
    p = model.module[0].weight
    if allow:  # torch refuses the assignment unless the parameter's grad_dtype is relaxed
        p.grad_dtype = None
    x, y = batches(1, world_size)[0]
    with model.no_sync():
        shard_backward(model, rank, world_size, x, y)

    def assign_then_sync():
        p.grad = p.grad.double()
        shard_backward(model, rank, world_size, x, y)
    return outcome(assign_then_sync)


def test_wrong_dtype_gradient_assigned_by_hand():
    for kind, message, _ in faults(wrong_dtype_grad, False):  # torch itself refuses
        assert kind == "RuntimeError" and "dtype" in message and "double" in message, message
    for kind, message, _ in faults(wrong_dtype_grad, True):  # gradsync names the parameter
        assert kind == "RuntimeError" and "'0.weight'" in message and "torch.float64" in message, message


def eval_on_one_rank(rank, world_size):
    model = gradsync.DDP(mlp(), timeout=TIMEOUT)
    x, y = batches(1, world_size)[0]
    shard_backward(model, rank, world_size, x, y)
    model.train(rank == 0)  # rank 1's next forward is in eval mode, its backward still synchronizes
    return outcome(lambda: shard_backward(model, rank, world_size, x, y))


def test_a_rank_in_eval_mode_is_named_as_a_likely_cause():
    for kind, message, _ in faults(eval_on_one_rank):
        assert kind == "SyncError" and "eval mode" in message, (kind, message)


def outside_the_group(rank, world_size, init_sync):
    group = dist.new_group([0])  # every rank creates it; rank 1 is not in it
    if rank == 0:
        return None
    try:
        gradsync.DDP(torch.nn.Linear(4, 4), process_group=group, init_sync=init_sync)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "constructed"


@pytest.mark.parametrize("init_sync", [True, False])
def test_a_process_group_this_rank_is_not_in_is_named_at_construction(init_sync):
    """It raised 'Dimension size must be non-negative' (a world size of -1), or constructed and then called the group
    destroyed at the first forward."""
    kind, message = run_ranks(outside_the_group, 2, init_sync, timeout=60)[1]
    assert kind == "ValueError" and "not a member" in message and "global rank 1" in message, message


def marked_by_torch(rank, world_size, how):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    if how == "ignore":  # a rank-local layer, as torch's DDP leaves it
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ["1.weight"])
    else:
        from torch.distributed.optim import _apply_optimizer_in_backward
        _apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.1})
    return outcome(lambda: gradsync.DDP(model))


@pytest.mark.parametrize("how, words", [("ignore", "'1.weight'"), ("in_backward", "_apply_optimizer_in_backward")])
def test_what_torchs_ddp_reads_off_the_module_and_gradsync_does_not_is_refused(how, words):
    """Ignored parameters were broadcast and averaged (a rank-local layer made equal); parameters stepped in their
    own backward stepped on this rank's gradient before any reduction (the replicas parted)."""
    for kind, message, _ in run_ranks(marked_by_torch, 2, how, timeout=60):
        assert kind == "NotImplementedError" and words in message, (kind, message)


def differing_construction(rank, world_size, how):
    import warnings
    torch.manual_seed(0)
    if how == "bias":
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2, bias=rank == 0))
    else:
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    kwargs = {}
    if how == "buffers":  # both skip the forwards' broadcasts; only rank 0 syncs its buffers at construction
        kwargs = dict(forward_sync_buffers=False) if rank == 0 else dict(broadcast_buffers=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return outcome(lambda: gradsync.DDP(net, timeout=60, **kwargs))


@pytest.mark.parametrize("how, words", [("buffers", "init_sync_buffers"), ("bias", "only on rank 0: ['2.bias']")])
def test_constructions_that_differ_are_named_on_every_rank(how, words):
    """Buffers synced at construction on one rank only: gloo aborted a process (the broadcasts differed in size). A
    missing bias was blamed on an option ('bucket_cap_mb')."""
    for kind, message, _ in run_ranks(differing_construction, 2, how, timeout=90):
        assert kind == "ValueError" and words in message, (kind, message)


def step_after_a_caught_check(rank, world_size, zero):
    model = gradsync.DDP(mlp(), timeout=TIMEOUT, check_finite=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if rank == 1:
        model.module[2].weight.register_hook(lambda g: g * float("nan"))
    x, y = batches(1, world_size)[0]
    try:
        shard_backward(model, rank, world_size, x, y)
    except FloatingPointError:
        pass
    if zero:
        opt.zero_grad()
    return outcome(opt.step)


@pytest.mark.parametrize("zero", [False, True], ids=["stepped_at_once", "zeroed_first"])
def test_a_step_after_a_synced_backward_that_raised_is_refused_until_zero_grad(zero):
    """.grad still held each rank's own gradient (NaN on rank 1), and the step went through: the replicas parted."""
    for kind, message, _ in faults(step_after_a_caught_check, zero):
        if zero:
            assert kind == "ok", message
        else:
            assert kind == "RuntimeError" and "unsynchronized gradients" in message, (kind, message)
