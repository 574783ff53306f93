"""The reduction's memory passes (issue 17 item 2): gradients as bucket views average during the
one copy into the bucket (or in place when ``.grad`` already is the bucket), never in a pass over
memory of their own, and without views the values stay bit-identical to torch's DDP. Slots under
``store.SMALL_SLOT`` elements are copied in and divided with their bucket in one call (issue 29:
per-parameter op overhead); their second touch is of memory just written, still in cache."""
import contextlib
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import gradsync
from gradsync.tools.launch import run_ranks
from helpers import Branches, batches, grads, mlp, reference_unused, shard

CAPS = dict(bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)


def train(rank, world_size, engine, view, set_to_none, accum, reduce_dtype=None):
    module = mlp(seed=0, width=48)
    if engine == "torch":
        model = nn.parallel.DistributedDataParallel(module, gradient_as_bucket_view=view,
                                                    bucket_cap_mb=CAPS["bucket_cap_mb"])
    else:
        extra = {} if reduce_dtype is None else {"reduce_dtype": reduce_dtype}
        model = gradsync.DDP(module, gradient_as_bucket_view=view, **CAPS, **extra)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    history = []
    for step, (x, y) in enumerate(batches(3 * accum, world_size)):
        x, y = shard(x, rank, world_size) * (1 + rank), shard(y, rank, world_size)  # ranks differ in scale
        if (step + 1) % accum:
            with model.no_sync():
                F.mse_loss(model(x), y).backward()
            continue
        F.mse_loss(model(x), y).backward()
        history.append(grads(model.module))
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return history


def assert_identical(a, b):
    for got, want in zip(a, b, strict=True):
        assert got.keys() == want.keys()
        for k in got:
            assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("accum", [1, 3])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_views_bit_identical_to_torch_and_to_gradsync_without_views(set_to_none, accum):
    runs = {(engine, view): run_ranks(train, 2, engine, view, set_to_none, accum)
            for engine in ("gradsync", "torch") for view in (False, True)}
    want = runs[("torch", False)]
    for key, got in runs.items():
        for rank in range(2):
            assert_identical(got[rank], want[rank])


def test_views_bit_identical_at_three_ranks_where_the_division_order_shows():
    # with W=3, dividing before or after the sum, or twice, changes the bits
    plain, views = (run_ranks(train, 3, "gradsync", view, True, 2) for view in (False, True))
    for rank in range(3):
        assert_identical(views[rank], plain[rank])


def test_reduce_dtype_views_bit_identical_to_reduce_dtype_without():
    plain, views = (run_ranks(train, 3, "gradsync", view, True, 2, torch.float64) for view in (False, True))
    for rank in range(3):
        assert_identical(views[rank], plain[rank])


class CountOps(TorchDispatchMode):
    """Count the ops that read or write gradient memory (``storages``: bucket buffers and grads); a
    foreach op counts once per tensor of its first list that does."""

    def __init__(self, storages):
        super().__init__()
        self.ops, self.storages = Counter(), storages

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.startswith("_foreach_"):
            self.ops[func.__name__] += sum(t.untyped_storage().data_ptr() in self.storages for t in args[0])
            return func(*args, **(kwargs or {}))
        tensors = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        if any(t.untyped_storage().data_ptr() in self.storages for t in tensors):
            self.ops[func.__name__] += 1
        return func(*args, **(kwargs or {}))


def count_passes(rank, world_size, view, set_to_none, width=48):
    """Ops of one steady synced backward that touch bucket buffers or the gradients; the number of
    parameters, of buckets, and of parameters of at least ``SMALL_SLOT`` elements."""
    from gradsync.engine.store import SMALL_SLOT
    model = gradsync.DDP(mlp(seed=0, width=width), gradient_as_bucket_view=view, **CAPS)
    x, y = (shard(t, rank, world_size) for t in batches(1, world_size)[0])
    for _ in range(3):  # the first synced backward re-plans the buckets; count a steady one
        model.zero_grad(set_to_none=set_to_none)
        loss = F.mse_loss(model(x), y)
        storages = {b.buffer.untyped_storage().data_ptr() for b in model.reducer.buckets}
        storages |= {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
        with CountOps(storages) as mode:
            loss.backward()
    big = sum(p.numel() >= SMALL_SLOT for p in model.reducer.params)
    return dict(mode.ops), len(model.reducer.params), len(model.reducer.buckets), big


@pytest.mark.parametrize("set_to_none", [True, False])
def test_views_average_without_a_pass_of_their_own(set_to_none):
    ops, n, buckets, big = run_ranks(count_passes, 2, True, set_to_none)[0]
    ops.pop("add_.Tensor", None)  # autograd accumulating into an existing .grad
    assert big == 0  # every slot small: averaged with its bucket, one op per bucket
    if set_to_none:  # a fresh .grad: one copy into the bucket per parameter (one call per bucket), scaled by 1 / W
        assert ops == {"_foreach_copy_.default": n, "mul_.Tensor": buckets}, ops
    else:  # .grad already is the bucket view: one in-place division per bucket (as torch's reducer)
        assert ops == {"div_.Tensor": buckets}, ops


def test_large_slots_divide_on_their_one_copy_in():
    ops, n, buckets, big = run_ranks(count_passes, 2, True, True, 128)[0]
    ops.pop("add_.Tensor", None)
    assert 0 < big < n and buckets < n  # a bucket holds a weight and a bias: the bias is divided alone
    assert ops["mul.out"] == big and ops["_foreach_copy_.default"] == n - big, ops  # each slot written once
    # the small ones: a whole-bucket scaling where the bucket has no large slot, else one call for them
    assert set(ops) <= {"mul.out", "_foreach_copy_.default", "mul_.Tensor", "_foreach_mul_.Scalar"}, ops
    assert ops.get("mul_.Tensor", 0) <= buckets and ops.get("_foreach_mul_.Scalar", 0) <= n - big, ops


def test_without_views_one_divided_copy_in_and_one_copy_back():
    ops, n, buckets, big = run_ranks(count_passes, 2, False, False)[0]
    ops.pop("add_.Tensor", None)
    # copied in one call per bucket (the per-tensor count is the dispatch mode's), back in one call
    assert ops == {"mul_.Tensor": buckets, "_foreach_copy_.default": 2 * n}, ops


# ---------------------------------------------------------------- a local backward's new gradients, per bucket
PATTERN = [(True, False), (False, True), (False, False), (True, True)]  # micro-step k uses b on (rank 0, rank 1)


def unused_in_local_backwards(rank, world_size, caps):
    model = gradsync.DistributedDataParallel(Branches(), gradient_as_bucket_view=True, find_unused_parameters=True,
                                             **caps)
    views = model.reducer.store.views
    for k, (x, y) in enumerate(batches(len(PATTERN), world_size)):
        with model.no_sync() if k < len(PATTERN) - 1 else contextlib.nullcontext():
            F.mse_loss(model(shard(x, rank, world_size), use_b=PATTERN[k][rank]), shard(y, rank, world_size)).backward()
        # a bucket whose member this backward did not produce completes at its end: every .grad is its slot
        assert all(p.grad is None or p.grad.data_ptr() == v.data_ptr() for p, v in zip(model.parameters(), views)), k
    return {n.removeprefix("module."): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("caps", [{}, CAPS], ids=["one-bucket", "a-bucket-each"])
def test_a_local_backward_that_leaves_a_bucket_incomplete_still_takes_its_gradients_in(caps):
    want = reference_unused(PATTERN, 2)
    for got in run_ranks(unused_in_local_backwards, 2, caps):
        assert set(got) == set(want)
        for name, grad in got.items():
            torch.testing.assert_close(grad, want[name], atol=1e-6, rtol=1e-5)
