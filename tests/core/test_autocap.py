"""``bucket_cap_mb="auto"``: the link fit, the simulation, and the choice in real gloo runs."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradsync
from gradsync.core.autocap import MEASURED_SYNCS, LinkModel, choose_cap, fit_link, predict_end, ready_times
from gradsync.core.buckets import MiB, plan_buckets
from gradsync.tools.launch import run_ranks
from helpers import assert_close_dicts, batches, grads, mlp, params, shard


def record(buckets, start=0.0, ready=None):
    return {"backward_start": start, "params": ready or {},
            "buckets": [{"bytes": b, "launch": l, "done": d} for b, l, d in buckets]}


def test_fit_recovers_latency_and_bandwidth():
    link = LinkModel(latency=2e-3, seconds_per_byte=1e-9)
    # launched back to back: each starts when the previous one is done
    sizes, t, rows = [MiB, 25 * MiB, 8 * MiB, 25 * MiB], 0.0, []
    for b in sizes:
        rows.append((b, t, t + link.cost(b)))
        t += link.cost(b)
    fitted = fit_link([record(rows)])
    assert fitted.latency == pytest.approx(2e-3, rel=1e-6)
    assert fitted.seconds_per_byte == pytest.approx(1e-9, rel=1e-6)


def test_fit_counts_a_late_launch_from_the_launch_not_the_previous_finish():
    rows = [(MiB, 0.0, 0.002), (2 * MiB, 0.010, 0.013)]  # the second waited for its gradients
    fitted = fit_link([record(rows)])
    assert fitted.latency == pytest.approx(0.001) and fitted.seconds_per_byte == pytest.approx(0.001 / MiB)


def test_fit_with_one_size_or_no_growth_has_no_negative_terms():
    same = fit_link([record([(MiB, 0.0, 0.004), (MiB, 0.004, 0.008)])])
    assert same.latency == 0.0 and same.seconds_per_byte == pytest.approx(0.004 / MiB)
    flat = fit_link([record([(MiB, 0.0, 0.004), (4 * MiB, 0.004, 0.007)])])
    assert flat.seconds_per_byte == 0.0 and flat.latency > 0
    with pytest.raises(ValueError, match="launch and a finish"):
        fit_link([record([])])


def test_ready_times_are_medians_since_backward_start():
    recs = [record([], start=s, ready={0: s + d, 1: s + 2 * d}) for s, d in ((10.0, 1.0), (20.0, 3.0), (30.0, 2.0))]
    assert ready_times(recs, 3) == [2.0, 4.0, 0.0]


def test_predict_end_launches_in_order_one_collective_at_a_time():
    link = LinkModel(latency=1.0, seconds_per_byte=0.0)
    nbytes = [4, 4, 4]
    assert predict_end([[0], [1], [2]], [0.0, 0.5, 5.0], nbytes, link) == 6.0  # 0-1, 1-2, 5-6
    assert predict_end([[2], [1], [0]], [0.0, 0.5, 5.0], nbytes, link) == 8.0  # bucket 0 waits until 5


def layers(n, mib):
    return [torch.empty(int(mib * MiB) // 4) for _ in range(n)]  # fp32


def test_cheap_latency_and_spread_gradients_choose_small_buckets():
    params = layers(17, 1)  # 17 MiB, gradients ready 10 ms apart from the last parameter backwards
    ready = [10e-3 * (16 - i) for i in range(17)]
    link = LinkModel(latency=1e-5, seconds_per_byte=5e-3 / MiB)  # 5 ms per MiB: keeps up with backward
    choice = choose_cap(params, None, ready, link, None)
    # 1 MiB buckets end 5 ms after the last gradient, 2 MiB ones 10 ms after: past the 2% tie
    assert choice.bucket_cap_mb == 1.0 and choice.buckets[1.0] == 17
    assert choice.predicted_ms[1.0] == pytest.approx(165.01) and choice.predicted_ms[2.0] == pytest.approx(170.01)
    assert set(choice.predicted_ms) == {1.0, 2.0, 4.0, 8.0, 16.0, 25.0}  # past the model's size: one bucket


def test_expensive_latency_chooses_one_bucket_and_ties_go_to_the_larger_cap():
    params = layers(16, 1)
    ready = [1e-4 * (15 - i) for i in range(16)]  # gradients all ready at once
    choice = choose_cap(params, None, ready, LinkModel(latency=50e-3, seconds_per_byte=1e-3 / MiB), None)
    assert choice.bucket_cap_mb == 16.0 and choice.first_bucket_cap_mb == 1.0
    free = choose_cap(params, None, ready, LinkModel(latency=0.0, seconds_per_byte=0.0), 0.5)
    assert free.bucket_cap_mb == 16.0 and free.first_bucket_cap_mb == 0.5  # all tie; the user's first cap


# ---------------------------------------------------------------- multi-rank
def wide(seed):
    return mlp(seed=seed, width=640, depth=4)  # ~3.3 MiB: candidates 1, 2 and 4 MiB plan differently


def auto_vs_torch(rank, world_size, view, steps):
    ours = gradsync.DDP(wide(rank), bucket_cap_mb="auto", gradient_as_bucket_view=view)
    theirs = nn.parallel.DistributedDataParallel(wide(rank))
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, theirs)]
    choices, history = [], []
    for x, y in batches(steps, world_size, per_rank=4):
        xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
        for model, opt in zip((ours, theirs), opts):
            opt.zero_grad()
            F.mse_loss(model(xs), ys).backward()
            opt.step()
        history.append((grads(ours.module), grads(theirs.module)))
        choices.append(ours.bucket_choice)
    r = ours.reducer
    expected = plan_buckets(r.params, r.bucket_cap_mb, r.first_bucket_cap_mb, r.plan_order)
    return (choices, history, params(ours.module), params(theirs.module), r.bucket_plan() == expected,
            r.trace, ours.grad_state_dict())


@pytest.mark.parametrize("view", [False, True])
def test_auto_cap_is_chosen_once_agreed_and_trains_like_torch(view):
    steps = MEASURED_SYNCS + 3  # the first backward re-plans the order; the next three are measured
    results = run_ranks(auto_vs_torch, 2, view, steps)
    caps = set()
    for choices, history, ours, theirs, planned, trace, state in results:
        assert all(c is None for c in choices[:MEASURED_SYNCS])
        chosen = choices[MEASURED_SYNCS]
        assert chosen is not None and all(c == chosen for c in choices[MEASURED_SYNCS:])
        assert chosen["bucket_cap_mb"] in chosen["predicted_ms"]  # rank 0's cap was among everyone's candidates
        caps.add(chosen["bucket_cap_mb"])
        assert planned and trace is None  # re-planned with the cap; the internal trace is off again
        assert state["bucket_caps"] == [chosen["bucket_cap_mb"], chosen["first_bucket_cap_mb"]]
        for g_ours, g_theirs in history:
            assert_close_dicts(g_ours, g_theirs, atol=1e-6)
        assert_close_dicts(ours, theirs, atol=1e-5)
    assert len(caps) == 1


def resume_with_auto(rank, world_size, state):
    model = gradsync.DDP(wide(0), bucket_cap_mb="auto")
    model.load_grad_state_dict(state)
    return model.reducer.bucket_cap_mb, model.reducer.bucket_plan(), model.bucket_choice


def test_a_resumed_run_keeps_the_chosen_cap():
    results = run_ranks(auto_vs_torch, 3, False, MEASURED_SYNCS + 1)
    state = results[0][-1]
    saved_plan = plan_buckets(list(wide(0).parameters()), *state["bucket_caps"],
                              [list(dict(wide(0).named_parameters())).index(n) for n in state["bucket_order"]])
    for cap, plan, choice in run_ranks(resume_with_auto, 3, state):
        assert cap == state["bucket_caps"][0] and plan == saved_plan
        assert choice["bucket_cap_mb"] == cap  # no new measurement after a resume


def bad_auto(rank, world_size):
    errors = []
    for make in (lambda: gradsync.DDP(mlp(), bucket_cap_mb="fast"),
                 lambda: gradsync.DDP(mlp(), bucket_cap_mb="auto", bucket_cap_mb_list=[1, 2]),
                 lambda: gradsync.ShardedDataParallel(mlp(), bucket_cap_mb="auto")):
        try:
            make()
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def test_bad_auto_settings_raise_clear_errors():
    for errors in run_ranks(bad_auto, 2):
        assert len(errors) == 3
        assert "size in MiB or \"auto\"" in errors[0] and "bucket_cap_mb_list" in errors[1]
        assert "ShardedDataParallel" in errors[2] and "at construction" in errors[2]


def uneven_auto(rank, world_size, counts):
    model = gradsync.DDP(mlp(seed=rank), bucket_cap_mb="auto")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with model.join():
        for x, y in batches(max(counts), world_size)[:counts[rank]]:
            F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
            opt.step()
            opt.zero_grad()
    return params(model.module), model.bucket_choice, model.reducer.bucket_plan()


@pytest.mark.parametrize("counts", [[6, 1], [2, 6], [6, 1, 3]])
def test_ranks_that_joined_early_take_part_in_the_choice(counts):
    """A joined rank shadows the measured backwards and the cap's broadcast (no hang, one layout)."""
    from test_join import reference
    results = run_ranks(uneven_auto, len(counts), counts, timeout=60)
    want = reference(len(counts), counts, False)
    for got, choice, plan in results:
        assert_close_dicts(got, want, atol=1e-5)
        assert choice is not None and choice["bucket_cap_mb"] == results[0][1]["bucket_cap_mb"]
        assert plan == results[0][2]
