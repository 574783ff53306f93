"""skip_all_reduce_unused_params=True: buckets that no rank uses are not all-reduced (engine/unused.py).

Each run builds torch's DDP and gradsync's over copies of one model in the same process group, with
one bucket per parameter on both (a 10 KiB cap), and compares gradients step by step.
"""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradsync
from helpers import run_ranks

CAP_MB = 0.01  # every weight (20 KB) fills a bucket of its own, on both wrappers


class ThreeWays(nn.Module):
    """``a`` always runs, ``b`` when asked, ``never`` never."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(50, 100, bias=False)
        self.b = nn.Linear(50, 100, bias=False)
        self.never = nn.Linear(50, 100, bias=False)

    def forward(self, x, use_b=False):
        out = self.a(x)
        return out + self.b(x) if use_b else out


def build(cls, skip, rank, static=False):
    unused = {"static_graph": True} if static else {"find_unused_parameters": True}
    model = cls(ThreeWays(), bucket_cap_mb=CAP_MB, skip_all_reduce_unused_params=skip, **unused)
    trace = model.enable_comm_trace() if isinstance(model, gradsync.DDP) else None
    return model, trace


def grads_of(model):
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.module.named_parameters()}


def launched(model, trace):
    """Names of the parameters whose buckets the latest synced backward launched a collective for."""
    record, reducer = trace[-1], model.reducer
    return sorted(reducer.names[i] for b in record["buckets"] if "launch" in b for i in reducer.buckets[b["index"]].members)


def run(rank, world_size, steps, skip, torch_skip=None, static=False):
    """``steps``: per step, (ranks using ``b``, whether the step is a no_sync micro-step); torch's DDP
    gets ``torch_skip`` (default: ``skip``)."""
    out = {}
    torch_ddp = torch.nn.parallel.DistributedDataParallel
    for name, cls, flag in (("torch", torch_ddp, skip if torch_skip is None else torch_skip),
                            ("gradsync", gradsync.DDP, skip)):
        model, trace = build(cls, flag, rank, static)
        history = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for k, (b_ranks, local) in enumerate(steps):
                x = torch.randn(4, 50, generator=torch.Generator().manual_seed(10 * k + rank))
                sync = model.no_sync() if local else torch.enable_grad()
                with sync:
                    F.mse_loss(model(x, use_b=rank in b_ranks), torch.ones(4, 100)).backward()
                if local:
                    continue
                data = model._get_ddp_logging_data()
                history.append({"grads": grads_of(model), "reduced": data.get("num_buckets_reduced"),
                                "launched": launched(model, trace) if trace is not None else None})
                model.zero_grad(set_to_none=True)
        out[name] = history
        out[name + "_warnings"] = [str(w.message) for w in caught if "skip_all_reduce_unused_params" in str(w.message)]
    return out


def assert_same_grads(theirs, ours):
    assert theirs.keys() == ours.keys()
    for n in theirs:
        if theirs[n] is None or ours[n] is None:
            assert theirs[n] is None and ours[n] is None, n
        else:
            torch.testing.assert_close(ours[n], theirs[n], atol=1e-6, rtol=1e-6, msg=n)


@pytest.mark.parametrize("static", [False, True], ids=["find_unused_parameters", "static_graph"])
def test_buckets_unused_on_every_rank_are_not_reduced_and_grads_match_torch(static):
    steady = [((), False)] * 4  # b and never unused on every rank, every step
    for out in run_ranks(run, 2, steady, True, None, static, timeout=60):
        for theirs, ours in zip(out["torch"], out["gradsync"]):
            assert_same_grads(theirs["grads"], ours["grads"])
            assert ours["grads"]["b.weight"] is None and ours["grads"]["never.weight"] is None
        # the first synced backward knows nothing yet: all three buckets; then only a's, as torch
        assert [h["launched"] for h in out["gradsync"]] == [["a.weight", "b.weight", "never.weight"]] + \
            [["a.weight"]] * 3
        assert [h["reduced"] for h in out["gradsync"]] == [3, 1, 1, 1]
        # torch logs at the next forward (and reduces static_graph's first iteration outside its buckets)
        assert [h["reduced"] for h in out["torch"]][2:] == [1, 1]
        assert out["gradsync_warnings"] == []


def test_without_the_flag_every_bucket_is_reduced():
    for out in run_ranks(run, 2, [((), False)] * 3, False, timeout=60):
        assert [h["reduced"] for h in out["gradsync"]] == [3, 3, 3]
        assert [h["reduced"] for h in out["torch"]][1:] == [3, 3]
        for theirs, ours in zip(out["torch"], out["gradsync"]):
            assert_same_grads(theirs["grads"], ours["grads"])


@pytest.mark.parametrize("case", ["used_again_on_one_rank", "used_under_no_sync"])
def test_a_skipped_bucket_that_gets_a_gradient_is_reduced_after_the_others(case):
    """torch requires the unused set to stay fixed (else its ranks desynchronize); gradsync reduces
    the bucket late, on every rank alike, with the gradients of a run without the flag."""
    if case == "used_again_on_one_rank":
        steps = [((), False), ((), False), ((1,), False), ((), False)]
    else:  # b used in a no_sync micro-step, unused in the synced backward that follows
        steps = [((), False), ((), False), ((0, 1), True), ((), False)]
    # reference: torch's DDP without the flag (with it, torch's ranks would issue different collectives)
    for out in run_ranks(run, 2, steps, True, False, timeout=60):
        for theirs, ours in zip(out["torch"], out["gradsync"]):
            assert_same_grads(theirs["grads"], ours["grads"])
        late = out["gradsync"][2]
        assert late["grads"]["b.weight"] is not None
        assert late["launched"] == ["a.weight", "b.weight"]  # b's bucket: launched after the control
        assert late["reduced"] == 2
        assert len(out["gradsync_warnings"]) == 1 and "b.weight" in out["gradsync_warnings"][0]


def refusals(rank, world_size):
    out = {}
    for kwargs in ({}, {"static_graph": True}, {"find_unused_parameters": True}):
        try:
            gradsync.DDP(ThreeWays(), skip_all_reduce_unused_params=True, **kwargs)
            out[str(kwargs)] = "ok"
        except ValueError as exc:
            out[str(kwargs)] = str(exc)
    return out


def test_the_flag_needs_find_unused_parameters():
    for out in run_ranks(refusals, 2):
        assert "find_unused_parameters=True" in out["{}"] and "could never apply" in out["{}"]
        assert out["{'static_graph': True}"] == "ok" and out["{'find_unused_parameters': True}"] == "ok"


def uneven(rank, world_size, skip):
    """model.join() with one more batch on rank 0: every rank shadows the same collectives."""
    model = gradsync.DDP(ThreeWays(), find_unused_parameters=True, bucket_cap_mb=CAP_MB,
                         skip_all_reduce_unused_params=skip)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):  # learn the unused buckets before the join
        F.mse_loss(model(torch.randn(4, 50)), torch.ones(4, 100)).backward()
        opt.step()
        opt.zero_grad()
    reduced_before = model._get_ddp_logging_data()["num_buckets_reduced"]
    with model.join():
        for k in range(3 + (rank == 0)):
            F.mse_loss(model(torch.randn(4, 50, generator=torch.Generator().manual_seed(k + rank))),
                       torch.ones(4, 100)).backward()
            opt.step()
            opt.zero_grad()
    for _ in range(2):  # and again after it
        F.mse_loss(model(torch.randn(4, 50, generator=torch.Generator().manual_seed(9))),
                   torch.ones(4, 100)).backward()
        opt.step()
        opt.zero_grad()
    return reduced_before, model._get_ddp_logging_data()["num_buckets_reduced"], \
        {n: p.detach().clone() for n, p in model.module.named_parameters()}


def test_join_with_uneven_inputs_stays_in_step():
    torch.manual_seed(0)
    on = run_ranks(uneven, 2, True, timeout=60)
    torch.manual_seed(0)
    off = run_ranks(uneven, 2, False, timeout=60)
    for rank in range(2):
        assert on[rank][0] == 1 and on[rank][1] == 1 and off[rank][1] == 3
    for n in on[0][2]:
        torch.testing.assert_close(on[0][2][n], on[1][2][n], atol=0, rtol=0)  # ranks agree bit for bit
        torch.testing.assert_close(on[0][2][n], off[0][2][n], atol=0, rtol=0)  # and skipping changed nothing


class LargeNet(nn.Module):
    """torch's test_skip_all_reduce_unused_parameters model: ``fc1`` (1.9 MiB) runs, ``fc2`` (39 KiB) never."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(31415)
        self.fc1 = nn.Linear(100, 5000, bias=False)
        self.fc2 = nn.Linear(100, 100, bias=False)

    def forward(self, x):
        return self.fc1(x)


def large_net(rank, world_size):
    """torch's test_skip_all_reduce_unused_parameters on both wrappers: a 1.5 MiB cap, 10 steps."""
    out = {}
    for name, cls in (("torch", torch.nn.parallel.DistributedDataParallel), ("gradsync", gradsync.DDP)):
        for skip in (False, True):
            model = cls(LargeNet(), find_unused_parameters=True, bucket_cap_mb=1.5, skip_all_reduce_unused_params=skip)
            x = torch.randn(20, 100, generator=torch.Generator().manual_seed(rank))
            for _ in range(10):
                model(x).sum().backward()
            out[name, skip] = (model._get_ddp_logging_data().get("num_buckets_reduced"),
                               [p.detach().clone() for p in model.parameters()])
    return out


def test_torchs_skip_test_model_counts_the_buckets_gradsync_reduced():
    """torch's test_skip_all_reduce_unused_parameters expects 2 reduced buckets without the flag and 1 with
    it: torch 2.13's first layout closes buckets walking the parameters in registration order, so fc1 and
    fc2 get a bucket each. gradsync keeps its own layout (reverse registration order, so both share one
    bucket): taking torch's would change the summation order of every find_unused_parameters run at three
    or more ranks (tests/golden). The count is the buckets gradsync reduced, and the weights are torch's."""
    for out in run_ranks(large_net, 2, timeout=90):
        assert out["torch", False][0] == 2 and out["torch", True][0] == 1  # torch's own test's numbers
        assert out["gradsync", False][0] == 1  # fc1 and fc2 share gradsync's one bucket, which fc1 uses
        assert out["gradsync", True][0] == 1
        for skip in (False, True):
            for theirs, ours in zip(out["torch", skip][1], out["gradsync", skip][1]):
                torch.testing.assert_close(ours, theirs)
