"""The control protocol's checks and bounded waits on hand-made tensors, and what a phase header carries (2 ranks)."""
import time
from datetime import timedelta

import pytest
import torch

import gradsync
from gradsync.engine.control import CARRIED, PAYLOAD, Verdict, bounded_wait, control_tensor, empty_control
from gradsync.engine.errors import SyncError
from gradsync.engine.checks import check_finite
from helpers import mlp, run_ranks


def check_agreement(total, *, rank, world_size, n, active, sync_count):
    return Verdict(total, rank, world_size, n, active, sync_count)


def reduced(*controls):
    """What the all-reduce (a sum) of the ranks' controls returns."""
    return torch.stack(controls).sum(0)


def test_layout_sums_to_every_rank_counters_and_used_counts():
    w, used = 3, [True, False, True, True]
    total = reduced(*(control_tensor(r, w, backward_count=5, forward_count=7, used=used) for r in range(w)))
    assert total[:w].tolist() == [5, 5, 5]
    assert Verdict(total, 0, w, len(used), list(range(w)), 0).counts == [3, 0, 3, 3]
    assert total[w + len(used):2 * w + len(used)].tolist() == [7, 7, 7]
    assert int(total[-1]) == w
    assert empty_control(w, len(used)).shape == total.shape


def test_agreeing_ranks_pass():
    total = reduced(*(control_tensor(r, 2, 4, 4, [True]) for r in range(2)))
    check_agreement(total, rank=0, world_size=2, n=1, active=[0, 1], sync_count=3)


def test_different_backward_counts_name_every_rank():
    total = reduced(control_tensor(0, 2, 4, 4, [True]), control_tensor(1, 2, 5, 5, [True]))
    with pytest.raises(SyncError, match=r"rank 0: forward 4, backward 4, rank 1: forward 5, backward 5"):
        check_agreement(total, rank=1, world_size=2, n=1, active=[0, 1], sync_count=3)


def test_skipped_backward_shows_in_the_forward_counters():
    total = reduced(control_tensor(0, 2, 4, 4, [True]), control_tensor(1, 2, 4, 5, [True]))
    with pytest.raises(SyncError, match="a forward without backward counts as skipped"):
        check_agreement(total, rank=0, world_size=2, n=1, active=[0, 1], sync_count=3)


def test_control_paired_with_another_collective_is_recognised():
    # e.g. the other rank's bucket all-reduce landed here: the present count is not the world size
    mine = control_tensor(0, 2, 4, 4, [True])
    total = mine + torch.full_like(mine, 3)
    with pytest.raises(SyncError, match="paired with a different collective"):
        check_agreement(total, rank=0, world_size=2, n=1, active=[0, 1], sync_count=3)


def test_joined_ranks_must_send_zeros():
    total = reduced(control_tensor(0, 2, 4, 4, [True]), empty_control(2, 1))
    check_agreement(total, rank=0, world_size=2, n=1, active=[0], sync_count=0)
    with pytest.raises(SyncError, match="paired with a different collective"):
        check_agreement(total, rank=0, world_size=2, n=1, active=[0, 1], sync_count=0)


def test_missing_gradients_are_named_with_the_flag():
    names, params = ["a.weight", "b.weight"], [torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)]
    check_agreement(reduced(*(control_tensor(r, 2, 4, 4, [True, True]) for r in range(2))),
                    rank=0, world_size=2, n=2, active=[0, 1], sync_count=0).check_missing(names, params)
    verdict = check_agreement(reduced(control_tensor(0, 2, 4, 4, [True, True]), control_tensor(1, 2, 4, 4, [True, False])),
                              rank=0, world_size=2, n=2, active=[0, 1], sync_count=0)
    with pytest.raises(RuntimeError, match=r"1 parameter\(s\).*: b.weight\..*find_unused_parameters=True"):
        verdict.check_missing(names, params)
    params[1].requires_grad_(False)  # frozen here, but another rank produced its gradient: still refused
    with pytest.raises(RuntimeError, match=r"1 parameter\(s\).*: b.weight\."):
        verdict.check_missing(names, params)
    nowhere = check_agreement(reduced(*(control_tensor(r, 2, 4, 4, [True, False]) for r in range(2))),
                              rank=0, world_size=2, n=2, active=[0, 1], sync_count=0)
    nowhere.check_missing(names, params)  # frozen on every rank: left alone
    params[1].requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"1 parameter\(s\).*: b.weight\."):
        nowhere.check_missing(names, params)


def test_non_finite_gradients_are_named():
    params = [torch.zeros(2), torch.zeros(3), torch.zeros(1)]
    names = ["x", "y", "z"]
    good = [torch.zeros(5), torch.zeros(1)]
    check_finite(good, [[0, 1], [2]], params, names)
    bad = [torch.tensor([0.0, 0.0, 0.0, float("nan"), 0.0]), torch.tensor([float("inf")])]
    with pytest.raises(FloatingPointError, match=r"2 parameter\(s\) contains NaN or inf: y, z"):
        check_finite(bad, [[0, 1], [2]], params, names)


def test_bounded_wait_on_futures():
    done = torch.futures.Future()
    done.set_result(torch.ones(1))
    bounded_wait(done, timedelta(seconds=1))

    failed = torch.futures.Future()
    failed.set_exception(ValueError("boom"))
    with pytest.raises(ValueError, match="boom"):
        bounded_wait(failed, timedelta(seconds=1))

    never = torch.futures.Future()
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        bounded_wait(never, timedelta(seconds=0.2))
    assert time.monotonic() - start < 5


def test_a_synced_backwards_header_carries_its_values_once_and_the_standing_ones_every_time():
    """``carry`` (the accumulator's) goes with the next synced backward only; ``standing`` (elastic membership's join
    requests and stop) with every one, after them; every rank reads every rank's values."""
    def fn(rank, world_size):
        model = gradsync.DistributedDataParallel(mlp())
        plane = model.reducer.plane
        with pytest.raises(ValueError, match=f"carries at most {CARRIED} values"):
            plane.carry([1.0] * (CARRIED + 1))
        plane.standing = lambda: (10.0 + rank, float(rank))
        read = plane.carry([1.0 + rank, 2.0])
        seen = []
        for _ in range(2):
            model(torch.ones(2, 8)).sum().backward()
            seen.append(read())
        return seen
    for first, second in run_ranks(fn, 2):
        assert first == {r: (1.0 + r, 2.0, 0.0, 0.0, 10.0 + r, float(r)) for r in range(2)}
        assert second == {r: (0.0,) * CARRIED + (10.0 + r, float(r)) for r in range(2)}
        assert len(first[0]) == PAYLOAD
