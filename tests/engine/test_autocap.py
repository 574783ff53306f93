"""``bucket_cap_mb="auto"``: candidate layouts, the choice, and the schedule in real gloo runs."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradsync
from gradsync.engine.autocap import (CANDIDATES_MB, LINK_TIE, ROUNDS, choose, choose_by_link, default_cap, distinct_layouts,
                                   first_cap, fit_link, param_ready, predict_end, syncs_to_choose)
from gradsync.engine.layout import MiB, plan_buckets
from gradsync.tools.launch import run_ranks
from helpers import assert_close_dicts, batches, grads, mlp, params, shard


def layers(*mib):
    return [torch.empty(int(m * MiB) // 4) for m in mib]  # fp32


def test_candidates_that_plan_the_same_layout_are_timed_once():
    params = layers(*[4] * 8)  # 32 MiB of 4 MiB layers: caps 1 and 4 both give one layer a bucket
    layouts = distinct_layouts(params, None, None)
    assert list(layouts) == [1.0, 16.0, 25.0]  # 64: the first bucket (1 MiB cap) and the rest, as 25
    assert [len(p) for p in layouts.values()] == [8, 3, 2]
    assert layouts[16.0] == plan_buckets(params, 16.0, 1.0)  # torch's 1 MiB first bucket
    small = distinct_layouts(layers(0.25, 0.25), None, None)
    assert list(small) == [1.0]  # the whole model fits every cap: nothing to time


def test_first_bucket_follows_torch_unless_given():
    assert first_cap(25.0, None) == 1.0 and first_cap(0.5, None) == 0.5 and first_cap(25.0, 3.0) == 3.0
    layouts = distinct_layouts(layers(*[1] * 6), None, 3.0)
    assert all(sum(1 for _ in plan[0]) == 3 for plan in layouts.values() if len(plan) > 1)


def test_the_default_stays_unless_another_cap_wins_every_round_clearly():
    rounds = {1.0: [100.0] * 4, 16.0: [90.0, 90.5, 91.0, 91.5], 25.0: [95.0] * 4, 64.0: [91.0, 91.5, 92.0, 91.5]}
    assert choose(rounds, 25.0) == 64.0  # 16 and 64 both clear; 64's median is within TIE of 16's
    assert choose({**rounds, 16.0: [80.0] * 4}, 25.0) == 16.0
    assert choose({1.0: [90.0, 90.0, 96.0, 90.0], 25.0: [95.0] * 4}, 25.0) == 25.0  # lost one round
    assert choose({1.0: [94.0] * 4, 25.0: [95.0] * 4}, 25.0) == 25.0  # faster, but within the tie
    layouts = distinct_layouts(layers(*[4] * 8), None, None)
    assert default_cap(layouts, layers(*[4] * 8), None, None) == 25.0
    small = layers(*[2] * 4)
    assert default_cap(distinct_layouts(small, None, None), small, None, None) == 16.0  # 25 plans what 16 plans


def test_the_schedule_length():
    assert syncs_to_choose(4) == 2 + ROUNDS * 4 and syncs_to_choose(1) == 1  # the last one gathers the timings


def small_auto(rank, world_size):
    model = gradsync.DDP(mlp(seed=rank), bucket_cap_mb="auto")
    choices = []
    for x, y in batches(2, world_size):
        F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
        choices.append(model.bucket_choice)
    return choices, model.reducer.trace


def test_a_model_with_one_layout_is_not_timed():
    for (first, second), trace in run_ranks(small_auto, 2):
        assert first == second and first["bucket_cap_mb"] == first["default_mb"] == 1.0  # 1 MiB plans it all
        assert first["measured_ms"] == {} and trace is None


# ---------------------------------------------------------------- multi-rank
def wide(seed):
    return mlp(seed=seed, width=1024, depth=5)  # ~12 MiB of 4 MiB layers: two distinct layouts


def schedule_length():
    return syncs_to_choose(len(distinct_layouts(list(wide(0).parameters()), None, None)))


def auto_vs_torch(rank, world_size, view, steps):
    ours = gradsync.DDP(wide(rank), bucket_cap_mb="auto", gradient_as_bucket_view=view)
    theirs = nn.parallel.DistributedDataParallel(wide(rank))
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, theirs)]
    choices, buckets, worst = [], [], 0.0
    for x, y in batches(steps, world_size, per_rank=4):
        xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
        for model, opt in zip((ours, theirs), opts):
            opt.zero_grad()
            F.mse_loss(model(xs), ys).backward()
            opt.step()
        mine, torchs = grads(ours.module), grads(theirs.module)
        worst = max(worst, max((mine[k] - torchs[k]).abs().max().item() for k in mine))
        choices.append(ours.bucket_choice)
        buckets.append(len(ours.reducer.buckets))
    r = ours.reducer
    expected = plan_buckets(r.params, *r.store.caps, r.store.plan_order)
    # small results only: the parent's heap, inherited by later tests' forks, would hide their allocations
    ours_p, theirs_p = params(ours.module), params(theirs.module)
    drift = max((ours_p[k] - theirs_p[k]).abs().max().item() for k in ours_p)
    state = ours.grad_state_dict()
    state = {k: state[k] for k in ("bucket_order", "bucket_caps")}
    return choices, buckets, worst, drift, r.bucket_plan() == expected, r.trace, state


@pytest.mark.parametrize("view", [False, True])
def test_auto_cap_times_each_layout_agrees_and_trains_like_torch(view):
    n = schedule_length()
    results = run_ranks(auto_vs_torch, 2, view, n + 1)
    caps = set()
    for choices, buckets, worst, drift, planned, trace, state in results:
        assert all(c is None for c in choices[:n - 1])
        chosen = choices[n - 1]
        assert chosen is not None and choices[n] == chosen
        layouts = list(chosen["buckets"].values())
        assert len(layouts) >= 2 and buckets[:n - 2] == layouts * ROUNDS  # each layout timed ROUNDS times
        assert buckets[n - 2] == layouts[-1]  # the synced backward that gathers the timings keeps the last layout
        assert buckets[-1] == chosen["buckets"][chosen["bucket_cap_mb"]]
        assert all(t > 0 for t in chosen["measured_ms"].values())
        assert all(len(t) == ROUNDS for t in chosen["rounds_ms"].values())
        if chosen["rule"] == "link model":  # the link took longer than the backward (autocap.LINK_BOUND)
            assert chosen["bucket_cap_mb"] == choose_by_link(chosen["link"]["predicted_ms"])
        else:
            assert chosen["bucket_cap_mb"] == choose(chosen["rounds_ms"], chosen["default_mb"])
        caps.add(chosen["bucket_cap_mb"])
        assert planned and trace is None  # re-planned with the cap; the internal trace is off again
        assert state["bucket_caps"] == [chosen["bucket_cap_mb"], chosen["first_bucket_cap_mb"]]
        assert worst < 1e-6  # every step's gradients, through every re-plan
        assert drift < 1e-5
    assert len(caps) == 1


def resume_with_auto(rank, world_size, state):
    model = gradsync.DDP(wide(0), bucket_cap_mb="auto")
    model.load_grad_state_dict({"gradients": {}, **state})
    return model.reducer.store.caps[0], model.reducer.bucket_plan(), model.bucket_choice


def test_a_resumed_run_keeps_the_chosen_cap():
    results = run_ranks(auto_vs_torch, 3, False, schedule_length())
    state = results[0][-1]
    names = list(dict(wide(0).named_parameters()))
    saved_plan = plan_buckets(list(wide(0).parameters()), *state["bucket_caps"],
                              [names.index(n) for n in state["bucket_order"]])
    for cap, plan, choice in run_ranks(resume_with_auto, 3, state):
        assert cap == state["bucket_caps"][0] and plan == saved_plan
        assert choice["bucket_cap_mb"] == cap and choice["measured_ms"] == {}  # nothing timed again


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


def auto_with_powersgd(rank, world_size, start, steps):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
    model = gradsync.DDP(wide(rank), bucket_cap_mb="auto")
    state = powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=start)
    try:
        model.register_comm_hook(state, powerSGD.powerSGD_hook)
    except ValueError as exc:
        return str(exc)
    for x, y in batches(steps, world_size, per_rank=4):
        model.zero_grad()
        F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
    return state.iter, model.bucket_choice is not None, {n: g.sum().item() for n, g in grads(model).items()}


def test_powersgd_state_must_start_after_the_choice():
    # PowerSGD's per-bucket error feedback would meet re-planned buckets while "auto" still chooses
    bound = syncs_to_choose(len(CANDIDATES_MB))
    for error in run_ranks(auto_with_powersgd, 2, bound - 1, 1):
        assert f"start_powerSGD_iter >= {bound}" in error and "bucket_cap_mb" in error
    (iters, chosen, g0), (_, _, g1) = run_ranks(auto_with_powersgd, 2, bound, bound + 2)
    assert iters == bound + 2 and chosen and g0 == g1  # compressed steps ran, and every rank agrees


def traced_auto(rank, world_size, steps):
    model = gradsync.DDP(wide(rank), bucket_cap_mb="auto")
    trace = model.enable_comm_trace()
    for x, y in batches(steps, world_size, per_rank=4):
        F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
    return len(trace), model.comm_trace is trace, model.bucket_choice is not None


def test_a_trace_the_user_enabled_outlives_the_choice():
    steps = schedule_length() + 2
    for recorded, same, chosen in run_ranks(traced_auto, 2, steps):
        assert chosen and same and recorded == steps


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
    from ddp.test_join import reference  # tests/ddp: the join reference
    results = run_ranks(uneven_auto, len(counts), counts, timeout=60)
    want = reference(len(counts), counts, False)
    for got, choice, plan in results:
        assert_close_dicts(got, want, atol=1e-5)
        assert choice is not None and choice["bucket_cap_mb"] == results[0][1]["bucket_cap_mb"]
        assert plan == results[0][2]


# ---------------------------------------------------------------- the link model
def link_record(start, sizes, ready, latency, bandwidth):
    """A traced synced backward over a link of ``latency`` and ``bandwidth``: buckets launch when ready
    and take the link one after another."""
    buckets, end = [], start
    for k, (size, r) in enumerate(zip(sizes, ready)):
        launch = start + r
        end = max(end, launch) + latency + size / bandwidth
        buckets.append({"index": k, "bytes": size, "ready": launch, "launch": launch, "done": end})
    return {"backward_start": start, "buckets": buckets, "backward_end": end}


def test_the_link_fit_recovers_latency_and_bandwidth_from_the_traced_all_reduces():
    # busy periods of 4 buckets (23 MB), of 1 (8 MB), and two of 1 (1 MB each, far apart)
    records = [link_record(0.0, [4e6, 1e6, 16e6, 2e6], [0.0, 0.001, 0.002, 0.05], 0.0005, 2.5e8),
               link_record(10.0, [8e6], [0.0], 0.0005, 2.5e8), link_record(20.0, [1e6, 1e6], [0.0, 0.5], 0.0005, 2.5e8)]
    latency, bandwidth = fit_link(records)
    assert latency == pytest.approx(0.0005, rel=1e-6) and bandwidth == pytest.approx(2.5e8, rel=1e-6)
    assert fit_link([]) is None
    # overlapping collectives share the link: the busy period counts, not each one's launch-to-done
    shared = {"backward_start": 0.0, "buckets": [{"index": 0, "bytes": 4e6, "launch": 0.0, "done": 0.08},
                                                 {"index": 1, "bytes": 4e6, "launch": 0.01, "done": 0.07}]}
    assert fit_link([shared]) == (0.0, pytest.approx(1e8))
    latency, bandwidth = fit_link([link_record(0.0, [4e6, 4e6], [0.0, 0.0], 0.0, 1e8)])  # one size
    assert latency == 0.0 and bandwidth == pytest.approx(1e8)


def test_the_predicted_end_and_the_choice_from_it():
    ready, nbytes = [0.03, 0.02, 0.01, 0.0], [4e6] * 4  # parameter 3's gradient is ready first
    per_layer, whole = [[3], [2], [1], [0]], [[3, 2, 1, 0]]
    # a slow link: per-layer buckets keep it busy from the first gradient; one bucket waits for the last
    assert predict_end(per_layer, ready, nbytes, 0.0, 1e8) == pytest.approx(0.16)
    assert predict_end(whole, ready, nbytes, 0.0, 1e8) == pytest.approx(0.03 + 0.16)
    # latency counts once per bucket
    assert predict_end(per_layer, ready, nbytes, 0.01, 1e8) == pytest.approx(0.2)
    assert choose_by_link({1.0: 160.0, 25.0: 190.0}) == 1.0
    assert choose_by_link({1.0: 160.0, 4.0: 160.0 * (1 + LINK_TIE / 2), 25.0: 190.0}) == 4.0  # fewer buckets
    assert choose_by_link({1.0: 160.0, 25.0: 160.0 * (1 + LINK_TIE / 2)}) == 25.0
    # a run on the 2 gbit link: 16 MiB predicted 2.6% later measured 5% slower than 1 MiB; the earliest wins
    assert choose_by_link({1.0: 154.0, 16.0: 158.0, 25.0: 174.0}) == 1.0


def test_each_parameters_ready_time_is_its_buckets_median():
    layout = [[3], [2, 1], [0]]
    records = [link_record(5.0 * j, [1, 2, 1], [0.0, 0.01 + 0.001 * j, 0.02], 0.0, 1e9) for j in range(3)]
    assert param_ready(records, layout, 4) == pytest.approx([0.02, 0.011, 0.011, 0.0])
    assert param_ready([], layout, 4) is None


LINKS: dict = {}  # per process (the ranks are forked): the emulated link's one thread


def slow_link(state, bucket):
    """The default all-reduce on a slow emulated link: its future ends bytes / 2 MB/s after the all-reduce and
    after the bucket before it (about a second per synced backward, so that the link bounds the step even when a
    loaded machine stretches the backward: at 4 MB/s a backward descheduled for 135 ms under two CPU burners came
    within 2x of the link's 254 ms). The wait runs on the link's own thread: a callback on an all-reduce that had
    already finished would run, and sleep, inside the backward (on a fast machine it did: the backward then took
    as long as the link, and the run did not look link-bound)."""
    import os
    import time
    from concurrent.futures import ThreadPoolExecutor

    import torch.distributed as dist
    link = LINKS.setdefault(os.getpid(), ThreadPoolExecutor(max_workers=1))
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size())
    seconds = buffer.numel() * buffer.element_size() / 2e6
    reduced, done = dist.all_reduce(buffer, async_op=True).get_future(), torch.futures.Future()

    def carry():
        try:
            reduced.wait()
            time.sleep(seconds)
            done.set_result(buffer)
        except BaseException as e:  # noqa: BLE001 - the future carries it to the waiting rank
            done.set_exception(e)

    link.submit(carry)
    return done


def auto_on_a_slow_link(rank, world_size, steps):
    model = gradsync.DDP(mlp(seed=0, width=512, depth=4), bucket_cap_mb="auto")  # 1 MiB layers
    model.register_comm_hook(None, gradsync.hooks.one_collective(slow_link))
    for x, y in batches(steps, world_size, per_rank=2):
        model.zero_grad()
        F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
    return model.bucket_choice


def test_a_link_bound_run_chooses_from_the_link_model_on_every_rank():
    params = list(mlp(width=512, depth=4).parameters())
    steps = syncs_to_choose(len(distinct_layouts(params, None, None))) + 1
    first, second = run_ranks(auto_on_a_slow_link, 2, steps, timeout=120)
    assert first == second and first is not None  # every rank chose the same from the same numbers
    link = first["link"]
    assert link["link_bound"] and 0 < link["gbytes_s"] < 0.05, link  # the emulated 2 MB/s, not loopback's GB/s
    assert set(link["predicted_ms"]) == set(first["buckets"])
    if first["rule"] == "link model":
        assert first["bucket_cap_mb"] == choose_by_link(link["predicted_ms"])
    else:  # the timings vetoed it: the link model's cap measured clearly slower than the default
        assert first["rule"].startswith("timed") and first["bucket_cap_mb"] == choose(first["rounds_ms"],
                                                                                      first["default_mb"])
