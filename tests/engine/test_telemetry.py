"""model.sync_report() and the straggler warning: what only the reducer sees (engine/telemetry.py)."""
import logging
import time

import pytest
import torch

import gradsync
from gradsync.engine.telemetry import RankSync, Stragglers, SyncReport
from helpers import cpu_hogs, mlp, run_ranks


def windows(rank, world_size, n, slow_rank=None, sleep=0.2, accum=1):
    """Train ``n`` windows; ``slow_rank`` sleeps ``sleep`` s in each synced backward. Return the report
    after each window (as plain tuples; None after the first: it reports the synced backward before the
    latest) and the warnings gradsync logged."""
    caught = []
    handler = logging.Handler()
    handler.emit = lambda record: caught.append(record.getMessage())
    logging.getLogger("gradsync").addHandler(handler)
    model = gradsync.DistributedDataParallel(mlp(), bucket_cap_mb=1e-4, first_bucket_cap_mb=1e-4)
    acc = gradsync.GradientAccumulator(model, steps=accum)
    g = torch.Generator().manual_seed(rank)
    reports, warned_at = [], None
    for w in range(n):
        for _ in range(accum):
            with acc.accumulate():
                loss = model(torch.randn(6, 8, generator=g)).square().mean()
                if rank == slow_rank and acc.sync_gradients:
                    loss.register_hook(lambda grad: time.sleep(sleep) or grad)  # inside this rank's backward
                acc.backward(loss)
        r = model.sync_report()
        reports.append(r and (r.sync, r.slowest, {k: (v.compute_ms, v.wait_ms) for k, v in r.ranks.items()}))
        if caught and warned_at is None:
            warned_at = w
    return reports, caught, warned_at


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_slow_rank_is_named_in_every_window_and_warned_within_three(world_size):
    slow = world_size - 1
    results = run_ranks(windows, world_size, 6, slow, timeout=120)
    first = results[0][0]
    for reports, caught, warned_at in results:
        assert reports == first  # the same report on every rank, to the microsecond
        assert reports[0] is None and [r[:2] for r in reports[1:]] == [(w, slow) for w in range(5)]
        assert warned_at is not None and warned_at <= 3, caught  # three reports: after the fourth window
        assert len(caught) == 1 and f"rank {slow} was the slowest in 3 of the last 3" in caught[0]
        assert "straggler" in caught[0]
    for _, slowest, ranks in first[1:]:
        assert ranks[slow][0] >= 190  # its own backward holds the 200 ms sleep
        for r in range(world_size - 1):  # the others' backwards do not, but they wait for it
            assert ranks[r][0] < ranks[slow][0] - 150 and ranks[r][1] >= 150, ranks


def test_accumulation_windows_report_the_synced_backward():
    results = run_ranks(windows, 2, 5, 1, 0.2, 3, timeout=120)
    reports, caught, _ = results[0]
    assert reports[0] is None and [r[0] for r in reports[1:]] == [0, 1, 2, 3] and {r[1] for r in reports[1:]} == {1}
    assert caught


def test_a_balanced_run_under_load_gives_no_warning():
    with cpu_hogs(2):
        results = run_ranks(windows, 3, 30, timeout=300)
    for reports, caught, _ in results:
        assert caught == [] and len(reports) == 30 and None not in reports[1:]


def report(slowest, times, sync=0):
    return SyncReport(sync, {r: RankSync(c, 0.0) for r, c in enumerate(times)}, slowest)


def test_an_episode_warns_once_and_a_new_one_again():
    s = Stragglers()
    assert [s.observe(report(1, [10, 300])) for _ in range(5)].count(None) == 4  # the third warns
    assert s.observe(report(0, [300, 10])) is None  # the episode ends
    texts = [s.observe(report(1, [10, 300])) for _ in range(3)]
    assert texts[:2] == [None, None] and "rank 1" in texts[2]


def test_noise_below_the_thresholds_never_warns():
    s = Stragglers()
    assert all(s.observe(report(1, [10, 40])) is None for _ in range(10))  # 4x slower but only 30 ms
    assert all(s.observe(report(1, [200, 280])) is None for _ in range(10))  # 80 ms slower but 1.4x
    assert all(s.observe(report(0, [10])) is None for _ in range(5))  # one rank: nobody to compare


def test_sync_report_is_none_until_the_second_synced_backward():
    def fn(rank, world_size):
        model = gradsync.DistributedDataParallel(mlp(), straggler_warning=False)
        before = model.sync_report()
        with model.no_sync():
            model(torch.ones(2, 8)).sum().backward()
        local = model.sync_report()
        model(torch.ones(2, 8)).sum().backward()
        first = model.sync_report()
        with model.no_sync():
            model(torch.ones(2, 8)).sum().backward()
        model(torch.ones(2, 8)).sum().backward()
        second = model.sync_report()
        return before, local, first, (second.sync, sorted(second.ranks)), model.reducer.stragglers
    for before, local, first, second, stragglers in run_ranks(fn, 2):
        assert before is None and local is None and first is None and stragglers is None
        assert second == (0, [0, 1])  # the first synced backward's, both ranks


def traced(rank, world_size, path):
    model = gradsync.DistributedDataParallel(mlp(), bucket_cap_mb=1e-4, first_bucket_cap_mb=1e-4,
                                             straggler_warning=False)
    model.enable_comm_trace()
    for _ in range(4):
        loss = model(torch.ones(4, 8)).square().mean()
        if rank == 1:
            loss.register_hook(lambda grad: time.sleep(0.1) or grad)
        loss.backward()
    model.export_trace(path)
    return len(model.reducer.buckets)


def test_export_trace_draws_every_rank_in_one_file(tmp_path):
    import json
    path = tmp_path / "trace.json"
    (buckets, _) = run_ranks(traced, 2, str(path))
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    for rank in (0, 1):
        mine = [e for e in spans if e["pid"] == rank]
        assert sum(e["name"].startswith("bucket") for e in mine) == 4 * buckets
        work = [e for e in mine if e["name"] == "own work"]
        waits = [e for e in mine if e["name"] == "waiting on the others"]
        assert len(work) == len(waits) == 3  # the last synced backward's times would ride in the next
        assert all((e["dur"] >= 90_000) == (rank == 1) for e in work)  # rank 1's 100 ms sleep, in microseconds
    ends = {e["pid"]: e["ts"] + e["dur"] for e in spans if e["name"] == "waiting on the others"}
    assert abs(ends[0] - ends[1]) < 1.0  # aligned on the end of each synced backward


def test_export_trace_without_a_trace_says_what_to_call():
    def fn(rank, world_size):
        with pytest.raises(RuntimeError, match="enable_comm_trace"):
            gradsync.DistributedDataParallel(mlp()).export_trace("unused.json")
    run_ranks(fn, 2)


def one_bucket(rank, world_size):
    """One bucket: the header is waited in the hook of the backward's last gradient. Rank 1 sleeps between its
    forward and its backward."""
    model = gradsync.DistributedDataParallel(mlp())
    for _ in range(3):
        loss = model(torch.randn(6, 8)).square().mean()
        if rank == 1:
            time.sleep(0.2)
        loss.backward()
    return model.sync_report()


def test_a_rank_that_waits_for_the_header_after_its_last_gradient_keeps_its_own_work():
    """The wait came after the last gradient's time was taken, and was subtracted from the work all the same:
    rank 0's compute_ms read 0.0 (and the straggler warning 'the median rank's 0 ms')."""
    for report in run_ranks(one_bucket, 2, timeout=120):
        assert report.ranks[0].compute_ms > 0, report
        assert report.ranks[0].wait_ms >= 150 and report.ranks[1].compute_ms >= 190, report


def traced_join(rank, world_size, path, batches):
    model = gradsync.DistributedDataParallel(torch.nn.Linear(8, 8), straggler_warning=False)
    model.enable_comm_trace()
    with model.join():
        for _ in range(batches[rank]):
            model(torch.randn(4, 8)).sum().backward()
    model.export_trace(path)
    return len(model.comm_trace)


def test_export_trace_draws_every_ranks_records_when_rank_0_ran_out_first(tmp_path):
    """It paired records by position in rank 0's list: with rank 0 done after 2 of 5, the others' last 3 were gone."""
    import json
    path = tmp_path / "trace.json"
    recorded = run_ranks(traced_join, 3, str(path), [2, 5, 5])
    events = json.loads(path.read_text())["traceEvents"]
    drawn = [sum(e["ph"] == "X" and e["name"].startswith("bucket") and e["pid"] == r for e in events) for r in range(3)]
    assert drawn == recorded, (drawn, recorded)


def noise_of_wide_dtypes(rank, world_size, dtype):
    torch.manual_seed(0)
    model = gradsync.DistributedDataParallel(torch.nn.Linear(4, 2).to(dtype))
    acc = gradsync.GradientAccumulator(model, steps=2, noise_scale=True)
    for _ in range(3):
        for _ in range(2):
            with acc.accumulate():
                acc.backward(model(torch.randn(3, 4, dtype=dtype)).abs().square().mean())
        model.zero_grad()
    return acc.noise_scale


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
def test_noise_scale_takes_float64_and_complex_gradients(dtype):
    """The bucket's norm was asked in float32: 'should be convertible without narrowing' on every rank."""
    values = run_ranks(noise_of_wide_dtypes, 2, dtype)
    assert values[0] is not None and values[0] == values[1]


def joined_report(rank, world_size):
    model = gradsync.DistributedDataParallel(mlp(), straggler_warning=False)
    with model.join():
        for _ in range([6, 6, 2][rank]):
            model(torch.randn(4, 8)).sum().backward()
    return model.sync_report()


def test_a_joined_rank_reads_the_same_report_as_the_active_ranks():
    """It shadowed their synced backwards without reading the report they carried: its own stayed at the one from
    before it joined (sync 0 where theirs said 4)."""
    reports = run_ranks(joined_report, 3)
    assert reports[0] is not None and reports[0].sync == 4 and reports[0] == reports[1] == reports[2], reports


class SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class SleepyStack(torch.nn.Module):
    """Six layers; the backward sleeps ``seconds`` between the third and the fourth layer's gradients."""

    def __init__(self, seconds):
        super().__init__()
        torch.manual_seed(0)
        self.layers, self.seconds = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(6)), seconds

    def forward(self, x):
        for k, layer in enumerate(self.layers):
            x = layer(SleepInBackward.apply(x, self.seconds) if k == 3 else x)
        return x


def slow_with_a_hook(rank, world_size):
    """Six buckets and a comm hook not declared one-collective: each bucket's launch waits for the one before,
    inside this rank's backward. Rank 1 sleeps 200 ms in the middle of its backward."""
    def hook(state, bucket):
        return torch.distributed.all_reduce(bucket.buffer().div_(world_size), async_op=True).get_future().then(
            lambda f: f.value()[0])
    model = gradsync.DistributedDataParallel(SleepyStack(0.2 if rank == 1 else 0.0), bucket_cap_mb=0.001,
                                             straggler_warning=False)
    model.register_comm_hook(None, hook)
    for _ in range(4):
        model(torch.randn(8, 64)).sum().backward()
    return model.sync_report()


def test_waits_for_an_earlier_bucket_inside_the_backward_are_waits_not_work():
    """Both ranks read about 200 ms of their own work: the wait for the bucket before, made in the hook of a comm hook
    that may start collectives from callbacks, counted as this rank's compute."""
    for report in run_ranks(slow_with_a_hook, 2, timeout=120):
        assert report.slowest == 1 and report.ranks[0].compute_ms < 100 <= report.ranks[0].wait_ms, report
