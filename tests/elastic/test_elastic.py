"""Failure drills: ``gradsync run`` with 3 replicas, one SIGKILLed at each point of a window.

Every survivor must finish the run with parameters bit-identical to the other survivors' and equal
(1e-5) to one process trained on exactly the micro-batches that were kept: the dead replica's
micro-steps count up to the window whose reduction it did not commit, none after.
"""
import contextlib
import time
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from elastic_train import ADAMW, CLIP, build_model, dataset, make_optimizer, micro_batch  # noqa: E402

from forked_cli import ForkedCLI, run_cli  # noqa: E402
from gradsync.elastic import ElasticSampler  # noqa: E402
from gradsync.elastic.data import deal  # noqa: E402

SCRIPT = Path(__file__).parent / "elastic_train.py"
WINDOWS, STEPS = 4, 3


def launch(tmp_path: Path, *script_args: str, replicas: int = 3, min_replicas: int = 2, max_restarts: int = 0,
           timeout: float = 150.0, windows: int = WINDOWS) -> subprocess.CompletedProcess:
    argv = ["run", "--replicas", str(replicas), "--min-replicas", str(min_replicas), "--max-restarts",
            str(max_restarts), str(SCRIPT), "--out", str(tmp_path), "--windows", str(windows), "--steps", str(STEPS),
            *script_args]
    try:
        return run_cli(argv, timeout=timeout)
    except subprocess.TimeoutExpired as exc:  # the launcher is killed; say what it and its replicas printed
        pytest.fail(f"gradsync run ran past {timeout:g}s; its stderr ends:\n{exc.stderr[-6000:]}")


def reference(events: list[dict], replicas: int, *, items: bool = False, steps: int = STEPS,
              buffers: bool = False, windows: int = WINDOWS, initial: int | None = None,
              bf16: bool = False, width: int = 16, adamw: bool = False, clip: bool = False,
              spare: bool = False, skipped: tuple = ()) -> list[torch.Tensor]:
    """One process trained on what was kept: replica r's micro-steps up to the window it left in, but those in
    ``skipped`` ((replica, window, micro-step))."""
    net = build_model(buffers, width, spare)
    if bf16:
        return bf16_reference(events, replicas, net.bfloat16(), steps, adamw=adamw, windows=windows)
    optimizer = torch.optim.AdamW(net.parameters(), **ADAMW) if adamw else make_optimizer(net.parameters())
    for w in range(windows):
        members = set(range(replicas if initial is None else initial))  # from the window it joined to the one it left in
        for e in events:
            if e["window"] <= w:
                members = (members - set(e["left"])) | set(e["joined"])
        kept = [(r, k) for r in sorted(members) for k in range(steps) if (r, w, k) not in skipped]
        batches = [micro_batch(r, w, k, items) for r, k in kept]
        if items:
            total = sum(x.shape[0] for x, _ in batches)
            loss = sum(torch.nn.functional.mse_loss(net(x), y, reduction="sum") for x, y in batches) / total
        else:
            loss = sum(torch.nn.functional.mse_loss(net(x), y) for x, y in batches) / len(batches)
        optimizer.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        optimizer.step()
    return [p.detach() for p in net.parameters()]


def bf16_reference(events: list[dict], replicas: int, net: torch.nn.Module, steps: int,
                   adamw: bool = False, windows: int = WINDOWS) -> list[torch.Tensor]:
    """The arithmetic of bf16 parameters with reduce_dtype=torch.float32: each micro-step's bf16 gradient of
    loss / steps added into a float32 sum per replica, the replicas' sums / W added in float32 (every member
    ran its window whole here, so that is the mean over what was kept), then cast to bf16 for SGD in bf16;
    ``adamw`` (ShardedOptimizer): AdamW steps float32 masters with the float32 mean, the parameters are them rounded."""
    masters = [p.detach().float() for p in net.parameters()] if adamw else None
    optimizer = torch.optim.AdamW(masters, **ADAMW) if adamw else make_optimizer(net.parameters())
    for w in range(windows):
        survived = members_in(events, w, replicas)
        total = [torch.zeros_like(p, dtype=torch.float32) for p in net.parameters()]
        for r in survived:
            sums = [torch.zeros_like(t) for t in total]
            for k in range(steps):
                x, y = micro_batch(r, w, k, False)
                net.zero_grad()
                (torch.nn.functional.mse_loss(net(x.bfloat16()), y.bfloat16()) / steps).backward()
                for s, p in zip(sums, net.parameters()):
                    s.add_(p.grad.float())
            for t, s in zip(total, sums):
                t.add_(s / len(survived))
        for p, t in zip(masters or net.parameters(), total):
            p.grad = t if adamw else t.to(torch.bfloat16)
        optimizer.step()
        with torch.no_grad():
            for p, m in zip(net.parameters(), masters or ()):
                p.copy_(m)
    return [p.detach() for p in net.parameters()]


def survivors(tmp_path: Path) -> dict[int, dict]:
    return {int(f.stem): torch.load(f) for f in sorted(tmp_path.glob("*.pt"))}


def agreeing(results: dict[int, dict], expected: list[int], log: str = "") -> dict:
    """Every expected member's result is there, bit-identical, with the same events, members and losses."""
    assert sorted(results) == expected, log[-4000:]
    first = results[expected[0]]
    for r in expected:
        assert all(torch.equal(a, b) for a, b in zip(results[r]["params"], first["params"])), r
        assert results[r]["timeout"] == first["timeout"], (r, results[r]["timeout"], first["timeout"])  # a joiner's too
        mine, theirs = results[r]["optimizer"], first["optimizer"]  # momentum buffers too, after a join
        assert mine["param_groups"] == theirs["param_groups"] and mine["state"].keys() == theirs["state"].keys()
        assert all(torch.equal(v, theirs["state"][k][name]) for k in mine["state"]  # momentum, or AdamW's moments
                   for name, v in mine["state"][k].items()), r
        assert (results[r]["events"], results[r]["members"], results[r]["lost"]) == \
            (first["events"], expected, first["lost"])
    return first


def check_run(tmp_path: Path, proc: subprocess.CompletedProcess, *, victim: int | None, window: int,
              items: bool = False, steps: int = STEPS, buffers: bool = False, bf16: bool = False,
              lost: int | None = None, adamw: bool = False, clip: bool = False, width: int = 16,
              spare: bool = False) -> dict[int, dict]:
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = survivors(tmp_path)
    first = agreeing(results, sorted({0, 1, 2} - {victim}), proc.stderr)
    events = first["events"]
    if victim is None:
        assert events == []
    else:
        assert [(e["generation"], e["window"], e["left"], e["joined"], e["micro_steps_lost"]) for e in events] \
            == [(1, window, [victim], [], steps if lost is None else lost)]
        assert events[0]["seconds"] < 30
    want = reference(events, 3, items=items, steps=steps, buffers=buffers, bf16=bf16, adamw=adamw, clip=clip, width=width,
                     spare=spare)
    for got, ref in zip(first["params"], want):  # bf16: a float32 sum of 3 ranks may round apart by one ulp
        torch.testing.assert_close(got, ref, atol=1e-3 if bf16 else 1e-5, rtol=2 ** -7 if bf16 else 0)
    return results


@pytest.mark.parametrize("point", ["forward", "local_backward", "before_reductions", "during_reductions",
                                   "after_reductions"])
def test_kill_before_the_commit_drops_the_window_of_the_dead_replica(tmp_path, point):
    proc = launch(tmp_path, "--victim", "2", "--window", "1", "--point", point)
    check_run(tmp_path, proc, victim=2, window=1)


@pytest.mark.parametrize("point", ["after_commit", "optimizer_step"])
def test_kill_after_the_commit_keeps_the_window_of_the_dead_replica(tmp_path, point):
    proc = launch(tmp_path, "--victim", "1", "--window", "1", "--point", point)
    check_run(tmp_path, proc, victim=1, window=2)


@pytest.mark.parametrize("point", ["after_commit", "optimizer_step"])
def test_a_skip_in_the_window_a_replica_dies_after_committing_is_kept_too(tmp_path, point):
    """The window's skip records are gathered after the commit: the victim is gone then, and the survivors gather
    them again among themselves."""
    proc = launch(tmp_path, "--victim", "1", "--window", "1", "--point", point, "--skip", "0,1,0")
    assert proc.returncode == 0, proc.stderr[-4000:]
    first = agreeing(survivors(tmp_path), [0, 2], proc.stderr)
    assert [(e["window"], e["left"]) for e in first["events"]] == [(2, [1])]
    for got, ref in zip(first["params"], reference(first["events"], 3, skipped={(0, 1, 0)})):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_a_replica_is_not_restarted_into_a_job_below_min_replicas(tmp_path):
    """The launcher restarted it before the survivor failed the job, and it died of a MembershipError traceback."""
    proc = launch(tmp_path, "--victim", "1", "--window", "1", "--point", "forward", replicas=2, min_replicas=2,
                  max_restarts=1)
    assert proc.returncode == 1
    assert "replica 1 (restart 0) died with SIGKILL; fewer than --min-replicas 2 remain, not restarting" in proc.stderr
    assert "restarting (1 of 1)" not in proc.stderr and "replica 1 (restart 1)" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("how", ["sys.exit", "raise"])
def test_the_survivors_exit_code_is_the_scripts_after_a_member_died(tmp_path, how):
    """A replica that held a dead member's group ends with os._exit (gloo would hold the interpreter's exit): it ended
    with 0 whatever the script gave sys.exit() or raised, and gradsync run called the job a success."""
    argv = ["run", "--replicas", "3", "--min-replicas", "2", "--max-restarts", "0", str(SCRIPT), "--out", str(tmp_path),
            "--windows", str(WINDOWS), "--steps", str(STEPS), "--victim", "2", "--window", "3", "--point", "forward",
            "--exit-code", "3", *(["--raise-exit"] if how == "raise" else [])]  # a new interpreter, as a user starts it
    proc = subprocess.run([sys.executable, "-m", "gradsync.tools.cli", *argv], capture_output=True, text=True,
                          timeout=150)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "replica 0 (restart 0) exited with code 3" in proc.stderr, proc.stderr[-3000:]


def test_a_replica_stopped_under_gradsync_run_is_killed_by_its_launcher_and_left_out(tmp_path):
    """SIGSTOP before its forward: its launcher beats for the machine, so the others could not tell it from a live
    replica until the collective's timeout and then the re-form's (30 s each here); the launcher sees it stopped and
    kills it after 5 s, and the survivors go on as after a kill in its forward."""
    proc = launch(tmp_path, "--victim", "2", "--window", "1", "--point", "freeze")
    check_run(tmp_path, proc, victim=2, window=1)
    assert "replica 2 (restart 0) has been stopped (SIGSTOP) for 5 s; killing it" in proc.stderr, proc.stderr[-3000:]
    assert "replica 2 (restart 0) died with SIGKILL" in proc.stderr


def test_a_replica_that_dies_inside_an_audit_leaves_it_incomplete_and_the_job_goes_on(tmp_path):
    proc = launch(tmp_path, "--victim", "1", "--window", "1", "--point", "audit", "--audit")
    results = check_run(tmp_path, proc, victim=1, window=2)  # its window 1 was committed and stepped
    assert all(r["audits"] == [(0, True), (1, False), (2, True), (3, True)] for r in results.values()), results


# a parameter no replica uses, in a bucket of its own that no replica all-reduces from the second synced backward on
SKIP_UNUSED = ["--spare", "--ddp", "find_unused_parameters=True", "--ddp", "skip_all_reduce_unused_params=True"]
OPTIONS = {"views": ["--ddp", "gradient_as_bucket_view=True"], "bf16": ["--bf16"], "static": ["--ddp", "static_graph=True"],
           "unused": ["--ddp", "find_unused_parameters=True"], "delay": ["--delay"], "skip_unused": SKIP_UNUSED}


def assert_spare_skipped(results: dict[int, dict]) -> None:
    """SKIP_UNUSED: every replica's last synced backward reduced every bucket but the spare's."""
    assert all(r["buckets_reduced"] == len(r["buckets"]) - 1 for r in results.values())


@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("point,victim,window", [("during_reductions", 2, 1), ("optimizer_step", 1, 2)])
def test_drills_with_the_options_a_large_model_runs(tmp_path, option, point, victim, window):
    """A bucket in flight, or just before the step, with gradient views (the window lives in the buckets) or
    bf16 parameters with reduce_dtype=torch.float32 (it lives in the float32 slots): each bucket reduces a copy."""
    proc = launch(tmp_path, "--victim", str(victim), "--window", "1", "--point", point, *OPTIONS[option])
    results = check_run(tmp_path, proc, victim=victim, window=window, bf16=option == "bf16", spare=option == "skip_unused")
    if option == "skip_unused":
        assert_spare_skipped(results)


@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("point,victim,window,lost", [("during_reductions", 2, 1, STEPS), ("optimizer_step", 1, 2, 0),
                                                      ("step_vote", 1, 2, 0), ("mirror_pass", 1, 1, STEPS)])
def test_sharded_adamw_drills_lose_no_shard(tmp_path, point, victim, window, lost, clip):
    """ShardedDataParallel + ShardedOptimizer(AdamW): each shard, gradient and AdamW state, lives on two members
    (sharded/regroup.py). A replica killed with a bucket in flight costs its window (also one killed after its first
    bucket's all-to-all, before it sends its shard's average to the rank mirroring it); one killed just before the
    step costs nothing (the survivors find it gone in the step's all-gathers, after the commit, and re-shard
    there; with ``clip``, in clip_grad_norm_'s all-reduce, which takes the norm again in the new group). One killed
    after the step's all-gathers, before the step's vote, is found in the vote. The survivors equal one process
    with plain AdamW on what was kept."""
    proc = launch(tmp_path, "--victim", str(victim), "--window", "1", "--point", point, "--sharded",
                  *(["--clip"] if clip else []))
    check_run(tmp_path, proc, victim=victim, window=window, lost=lost, adamw=True, clip=clip)


@pytest.mark.parametrize("point,victim,window,lost", [("during_reductions", 2, 1, STEPS), ("optimizer_step", 1, 2, 0)])
def test_sharded_adamw_with_a_loss_scaler_drills(tmp_path, point, victim, window, lost):
    """gradsync.ShardedGradScaler, then clipping: a replica killed just before the step is found in the scaler's
    all-reduce, after the commit; the survivors re-shard and check their new shards, each unscaled once (the mirrored
    one with its own), and equal one process with plain AdamW and no scaler (a power-of-two scale is exact)."""
    proc = launch(tmp_path, "--victim", str(victim), "--window", "1", "--point", point, "--sharded", "--scaler", "--clip")
    check_run(tmp_path, proc, victim=victim, window=window, lost=lost, adamw=True, clip=True)


@pytest.mark.parametrize("point,victim,window,lost", [
    ("local_backward", 2, 1, STEPS), ("during_reductions", 2, 1, STEPS), ("optimizer_step", 1, 2, 0)])
def test_sharded_bf16_with_reduce_dtype_drills(tmp_path, point, victim, window, lost):
    """bf16 parameters on ShardedDataParallel with reduce_dtype=torch.float32 and ShardedOptimizer(AdamW): the window
    lives in the float32 staging buckets from the first micro-step on, so a re-shard found at the synced backward
    carries it into the new layout (sharded/regroup.py). The survivors equal one process on the same arithmetic."""
    proc = launch(tmp_path, "--victim", str(victim), "--window", "1", "--point", point, "--sharded", "--bf16")
    check_run(tmp_path, proc, victim=victim, window=window, lost=lost, adamw=True, bf16=True)


def test_a_death_as_a_re_form_ends_re_forms_again(tmp_path):
    """4 replicas: replica 1 dies with a bucket in flight, and replica 2 once the survivors' new group formed, before
    it reported how long the re-form took. The others waited for its report with the store's wait, until the
    timeout, and then ended; they now see it gone and re-form again."""
    proc = launch(tmp_path, "--victim", "1", "--window", "1", "--point", "during_reductions",
                  "--dies-after-reform", "2", replicas=4)
    assert proc.returncode == 0, proc.stderr[-4000:]
    first = agreeing(survivors(tmp_path), [0, 3], proc.stderr)
    assert [e["left"] for e in first["events"]] == [[1], [2]], proc.stderr[-6000:]
    for got, ref in zip(first["params"], reference(first["events"], 4)):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_a_death_during_the_re_shard_re_forms_again(tmp_path):
    """4 replicas: replica 1 dies with a bucket in flight, and replica 3 as the survivors re-shard. The others'
    gathers end at once (bounded waits), nothing changed yet, so they re-form again and re-shard from the layout
    of 4 (shard 1 from its mirror on 0, shard 3 from its mirror on 2)."""
    proc = launch(tmp_path, "--victim", "1", "--window", "1", "--point", "during_reductions", "--sharded",
                  "--victim2", "3", replicas=4)
    assert proc.returncode == 0, proc.stderr[-4000:]
    first = agreeing(survivors(tmp_path), [0, 2], proc.stderr)
    events = [(e["generation"], e["window"], e["left"]) for e in first["events"]]
    assert events == [(1, 1, [1]), (2, 1, [3])], proc.stderr[-6000:]  # the membership logs why each re-form began
    for got, ref in zip(first["params"], reference(first["events"], 4, adamw=True)):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("bf16", [False, True])
def test_a_sharded_replica_that_rejoins_receives_its_shards(tmp_path, bf16):
    """The restarted replica joins at a boundary: the members and it re-shard over the new group (it contributes
    nothing, and takes its shard and the one it mirrors, AdamW state included, from the members; ``bf16``: with
    reduce_dtype=torch.float32, and the float32 masters)."""
    proc = launch(tmp_path, "--victim", "0", "--window", "1", "--point", "during_reductions", "--sleep", "0.1",
                  "--until-full", "3", "--sharded", *(["--bf16"] if bf16 else []), max_restarts=1, windows=40)
    assert proc.returncode == 0, proc.stderr[-4000:]
    first = agreeing(survivors(tmp_path), [0, 1, 2], proc.stderr)
    assert [(e["left"], e["joined"]) for e in first["events"]] == [([0], []), ([], [0])]
    want = reference(first["events"], 3, windows=first["windows"], adamw=True, bf16=bf16)
    for got, ref in zip(first["params"], want):
        torch.testing.assert_close(got, ref, atol=1e-3 if bf16 else 1e-5, rtol=2 ** -7 if bf16 else 0)


def test_a_replica_late_to_a_mirrored_pass_breaks_no_group(tmp_path):
    """Its peers waited for the shard it passes in 0.1 s slices; a gloo send or receive whose timed wait runs out
    closes every connection of the group, so a member descheduled for 0.3 s made the members re-form with nobody
    leaving (the elastic rejoin drill's flake under load)."""
    proc = launch(tmp_path, "--sharded", "--lag-pass", "1,2,0.3", windows=4)
    assert proc.returncode == 0, proc.stderr[-4000:]
    first = agreeing(survivors(tmp_path), [0, 1, 2], proc.stderr)
    assert first["events"] == [] and "replica 1 lagged 0.3 s" in proc.stderr, (first["events"], proc.stderr[-4000:])


@pytest.mark.parametrize("point,victim,window,same_as", [
    ("during_reductions", 2, 3, ["--window", "3"]), ("optimizer_step", 1, 3, ["--window", "4", "--kill-step", "0"]),
    ("local_backward", 2, 3, ["--window", "3", "--kill-step", "0"])])
def test_a_stateful_hook_is_rewound_when_a_reduction_fails(tmp_path, point, victim, window, same_as):
    """torch's PowerSGD (state on the default group, process_group=None) keeps a step count, error feedback, warm
    starts and a random state, which the failed reduction's buckets advanced: the survivors rewind it before they
    reduce again (engine/launcher.py). So a kill with buckets in flight, or just before the step, ends
    bit-identical to the same job whose replica died in a forward, before that reduction began (PowerSGD is
    lossy: one process on what was kept is no reference; it compresses from window 2). A kill in a no_sync backward
    is checked the same way."""
    runs = []
    for name, args in (("failed", ["--window", str(window), "--point", point]), ("before", [*same_as, "--point", "forward"])):
        (tmp_path / name).mkdir()
        proc = launch(tmp_path / name, "--victim", str(victim), *args, "--hook", "powersgd", windows=6)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs.append(agreeing(survivors(tmp_path / name), sorted({0, 1, 2} - {victim}), proc.stderr))
    assert all(torch.equal(a, b) for a, b in zip(runs[0]["params"], runs[1]["params"]))
    for got, ref in zip(runs[0]["params"], reference(runs[0]["events"], 3, windows=6)):  # and it trains
        torch.testing.assert_close(got, ref, atol=0.05, rtol=0.05)


def test_a_replica_that_rejoins_takes_the_stateful_hooks_state(tmp_path):
    """The joiner takes PowerSGD's step count, warm starts and random state from the members (its error feedback
    starts empty: it owes no residual), so every replica compresses alike and all three end bit-identical."""
    proc = launch(tmp_path, "--victim", "2", "--window", "3", "--point", "during_reductions", "--sleep", "0.1",
                  "--until-full", "3", "--hook", "powersgd", max_restarts=1, windows=40)
    assert proc.returncode == 0, proc.stderr[-4000:]
    first = agreeing(survivors(tmp_path), [0, 1, 2], proc.stderr)
    assert [(e["left"], e["joined"]) for e in first["events"]] == [([2], []), ([], [2])]
    for got, ref in zip(first["params"], reference(first["events"], 3, windows=first["windows"])):  # and it trains
        torch.testing.assert_close(got, ref, atol=0.05, rtol=0.05)


def each_batch_reference(events: list[dict], adamw: bool = False) -> list[torch.Tensor]:
    """sync_each_batch=True: each micro-step is the mean over the replicas that synced it (a replica that left
    keeps the micro-steps it synced before, ``committed``); the window is the mean of its micro-steps."""
    net = build_model()
    optimizer = torch.optim.AdamW(net.parameters(), **ADAMW) if adamw else make_optimizer(net.parameters())
    for w in range(WINDOWS):
        members = members_in(events, w)
        left = {r: e["committed"] for e in events if e["window"] == w for r in e["left"]}
        loss = 0
        for k in range(STEPS):
            ranks = members + [r for r, synced in left.items() if k < synced]
            loss = loss + sum(torch.nn.functional.mse_loss(net(x), y) for x, y in
                              (micro_batch(r, w, k, False) for r in ranks)) / (len(ranks) * STEPS)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return [p.detach() for p in net.parameters()]


@pytest.mark.parametrize("point,victim,window,kept", [("during_reductions", 2, 1, 2), ("after_commit", 1, 1, 1),
                                                      ("local_backward", 2, 1, 0)])
@pytest.mark.parametrize("sharded", [False, True])
def test_sync_each_batch_keeps_the_micro_steps_a_dead_replica_synced(tmp_path, point, victim, window, kept, sharded):
    """With sync_each_batch every micro-step commits: a replica that dies keeps the micro-steps it synced in its
    last window (``committed``), and loses the rest (``micro_steps_lost``). Sharded, the committed micro-steps are
    in the gradient shards, which the re-shard carries (the dead replica's from the member that mirrored it)."""
    proc = launch(tmp_path, "--victim", str(victim), "--window", "1", "--point", point, "--sync-each-batch",
                  *(["--sharded"] if sharded else []))
    assert proc.returncode == 0, proc.stderr[-4000:]
    first = agreeing(survivors(tmp_path), sorted({0, 1, 2} - {victim}), proc.stderr)
    assert [(e["window"], e["left"], e["committed"], e["micro_steps_lost"]) for e in first["events"]] == \
        [(window, [victim], kept, STEPS - kept)]
    for got, ref in zip(first["params"], each_batch_reference(first["events"], adamw=sharded)):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


AUTO = ["--width", "512", "--ddp", "bucket_cap_mb='auto'"]  # two layouts: chosen at synced backward 9's commit


@pytest.mark.parametrize("point,window,left_in", [("during_reductions", 4, 4), ("auto_gather", 9, 9),
                                                  ("optimizer_step", 4, 5)])
def test_bucket_cap_auto_chooses_the_same_on_the_survivors(tmp_path, point, window, left_in):
    """A replica dies while "auto" times its candidates (with a bucket in flight, or just before the step: the
    survivors find out in the next window), or inside the collective that gathers the timings: the survivors
    gather among themselves, choose the same cap and lay out the same buckets."""
    windows = 12
    proc = launch(tmp_path, "--victim", "2", "--window", str(window), "--point", point, *AUTO, windows=windows)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = survivors(tmp_path)
    first = agreeing(results, [0, 1], proc.stderr)
    assert [(e["window"], e["left"]) for e in first["events"]] == [(left_in, [2])]
    choice = first["bucket_choice"]
    assert choice is not None and choice["rule"] != "single layout" and len(choice["measured_ms"]) == 2
    assert all(r["bucket_choice"] == choice and r["buckets"] == first["buckets"] for r in results.values())
    for got, ref in zip(first["params"], reference(first["events"], 3, windows=windows, width=512)):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_bucket_cap_auto_a_replica_that_joins_takes_the_members_progress(tmp_path):
    """Replica 2 dies in window 2 and rejoins while the members time the candidates (or after they chose):
    it lays out their buckets, counts the rounds it missed as 0, and all three choose the same cap."""
    windows = 30
    proc = launch(tmp_path, "--victim", "2", "--window", "2", "--point", "during_reductions", "--sleep", "0.05",
                  "--until-full", "3", *AUTO, max_restarts=1, windows=windows)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = survivors(tmp_path)
    first = agreeing(results, [0, 1, 2], proc.stderr)
    assert all(r["bucket_choice"] == first["bucket_choice"] and r["buckets"] == first["buckets"] for r in results.values())
    assert first["bucket_choice"]["rule"] != "single layout"
    for got, ref in zip(first["params"], reference(first["events"], 3, windows=first["windows"], width=512)):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_bucket_cap_auto_a_replica_that_joins_after_the_choice_gets_the_members_record(tmp_path):
    """Replica 2 dies after the members chose (the timings are gathered in window 9) and rejoins: every replica, the
    joiner and the member that received the state beside it, reports the members' choice with its measurements (all
    but the sender held a bare "resumed" record before)."""
    windows = 24
    proc = launch(tmp_path, "--victim", "2", "--window", "14", "--point", "during_reductions", "--until-full", "3", *AUTO,
                  max_restarts=1, windows=windows)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = survivors(tmp_path)
    first = agreeing(results, [0, 1, 2], proc.stderr)
    assert first["bucket_choice"]["rule"] not in ("resumed", "single layout") and len(first["bucket_choice"]["measured_ms"]) == 2
    assert all(r["bucket_choice"] == first["bucket_choice"] and r["buckets"] == first["buckets"] for r in results.values())
    for got, ref in zip(first["params"], reference(first["events"], 3, windows=first["windows"], width=512)):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("point,victim,window", [("during_reductions", 2, 1), ("optimizer_step", 1, 2),
                                                  ("forward", 2, 1), ("local_backward", 2, 1)])
def test_drills_with_a_comm_hook_on_the_default_group(tmp_path, point, victim, window):
    """A hook whose state names no group reduces over the default one, which follows membership. The survivors
    agree bit for bit, and bf16 compression stays within 2e-3 of the float32 reference on what was kept
    (keeping the dead replica's window would be 1.7e-2 off). A hook with state of its own: below."""
    proc = launch(tmp_path, "--victim", str(victim), "--window", "1", "--point", point, "--hook", "bf16")
    assert proc.returncode == 0, proc.stderr[-4000:]
    first = agreeing(survivors(tmp_path), sorted({0, 1, 2} - {victim}), proc.stderr)
    assert [(e["window"], e["left"]) for e in first["events"]] == [(window, [victim])]
    for got, ref in zip(first["params"], reference(first["events"], 3)):
        torch.testing.assert_close(got, ref, atol=2e-3, rtol=0)


@pytest.mark.slow  # each replica compiles the model: about a minute on 2 cores
@pytest.mark.parametrize("point,victim,window", [("during_reductions", 2, 1), ("optimizer_step", 1, 2)])
def test_drills_with_torch_compile(tmp_path, point, victim, window):
    proc = launch(tmp_path, "--victim", str(victim), "--window", "1", "--point", point, "--compile", timeout=400)
    check_run(tmp_path, proc, victim=victim, window=window)


def test_overlap_optimizer_steps_only_what_every_member_committed(tmp_path):
    """The victim dies a second after its first buckets' all-reduces: the survivors hold those buckets' results
    by then. overlap_optimizer must not step them before the commit, or the window's re-reduction among the
    survivors would step them again (it did, before this test)."""
    proc = launch(tmp_path, "--victim", "2", "--window", "1", "--point", "during_reductions", "--kill-delay", "1",
                  "--overlap")
    check_run(tmp_path, proc, victim=2, window=1)


def test_item_counts_are_the_survivors(tmp_path):
    proc = launch(tmp_path, "--victim", "0", "--window", "2", "--point", "during_reductions", "--items")
    check_run(tmp_path, proc, victim=0, window=2, items=True)


def test_plain_ddp_without_an_accumulator(tmp_path):
    proc = launch(tmp_path, "--victim", "2", "--window", "1", "--point", "during_reductions", "--plain")
    check_run(tmp_path, proc, victim=2, window=1, steps=1)


def test_a_failed_buffer_broadcast_waits_for_the_window_end(tmp_path):
    """The victim dies after micro-step 0's broadcast: the survivors' next forward broadcast fails, they
    run the rest of the window on their own buffers and re-form at its synced backward."""
    proc = launch(tmp_path, "--victim", "2", "--window", "1", "--point", "forward", "--kill-step", "0", "--buffers")
    check_run(tmp_path, proc, victim=2, window=1, buffers=True)


def test_no_failure_no_event(tmp_path):
    check_run(tmp_path, launch(tmp_path), victim=None, window=0)


def test_below_min_replicas_every_survivor_raises(tmp_path):
    proc = launch(tmp_path, "--victim", "1", "--window", "1", "--point", "during_reductions", min_replicas=3)
    assert proc.returncode != 0
    assert "MembershipError" in proc.stderr and "only replicas [0, 2] are left" in proc.stderr, proc.stderr[-4000:]
    assert survivors(tmp_path) == {}


def test_a_restarted_replica_joins_at_a_window_boundary(tmp_path):
    """Replica 2 dies in window 1; gradsync run restarts it; it asks to join at its first accumulate()
    and the members admit it at their next window boundary, sending the parameters, SGD's momentum and
    the accumulator's position: at the end all three are bit-identical and equal to one process
    trained on what was kept (replica 2's micro-steps before window 1 and from its join on)."""
    windows = 40
    proc = launch(tmp_path, "--victim", "2", "--window", "1", "--point", "during_reductions", "--sleep", "0.1",
                  "--until-full", "3", max_restarts=1, windows=windows)
    assert proc.returncode == 0, proc.stderr[-4000:]
    first = agreeing(survivors(tmp_path), [0, 1, 2], proc.stderr)
    (left, joined) = first["events"]
    assert (left["generation"], left["window"], left["left"], left["joined"]) == (1, 1, [2], [])
    assert (joined["generation"], joined["left"], joined["joined"], joined["micro_steps_lost"]) == (2, [], [2], 0)
    assert joined["window"] > 1, proc.stderr[-3000:]
    want = reference(first["events"], 3, windows=first["windows"])
    for got, ref in zip(first["params"], want):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_a_replica_that_rejoins_reads_the_members_noise_scale_and_sync_report(tmp_path):
    """Both are documented the same on every rank. The joiner started its noise scale's running sums afresh (16.5
    against 25.6 at the next window, apart for good), and in the first window after the join the members returned
    the report from before the re-formation where the joiner had none."""
    proc = launch(tmp_path, "--victim", "2", "--window", "1", "--point", "during_reductions", "--sleep", "0.1",
                  "--until-full", "3", "--noise", max_restarts=1, windows=12)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = survivors(tmp_path)
    first = agreeing(results, [0, 1, 2], proc.stderr)
    joined = first["events"][1]["window"]
    seen = {r: {w: rest for w, *rest in results[r]["observed"] if w >= joined} for r in results}
    assert len(seen[2]) >= 2 and any(v[0] is not None for v in seen[2].values()), seen[2]
    for w, mine in seen[2].items():
        assert seen[0][w] == seen[1][w] == mine, (w, seen[0][w], mine)


def test_a_replica_that_rejoins_skips_the_buckets_the_members_skip(tmp_path):
    """skip_all_reduce_unused_params=True: the members skip the bucket no member used in the last synced backward;
    a replica that joins takes that set with their state, so it launches the same collectives (without it, its
    first synced backward would all-reduce a bucket the members skip). All three end bit-identical, equal to one
    process on what was kept, the unused parameter as it was built."""
    proc = launch(tmp_path, "--victim", "2", "--window", "1", "--point", "during_reductions", "--sleep", "0.1",
                  "--until-full", "3", *SKIP_UNUSED, max_restarts=1, windows=12)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = survivors(tmp_path)
    first = agreeing(results, [0, 1, 2], proc.stderr)
    assert [(e["left"], e["joined"]) for e in first["events"]] == [([2], []), ([], [2])]
    assert_spare_skipped(results)
    want = reference(first["events"], 3, windows=first["windows"], spare=True)
    for got, ref in zip(first["params"], want):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(first["params"][0], build_model(spare=True).spare, atol=0, rtol=0)


REFUSALS = """
import torch, gradsync
gradsync.elastic.init_process_group("gloo", timeout=30)
net = torch.nn.Linear(4, 4)
model = gradsync.DistributedDataParallel(net, delay_all_reduce_named_params=[("bias", net.bias)],
                                         param_to_hook_all_reduce=net.weight)
print("delayed in the buckets:", model.delayed is None and len(model.reducer.params) == 2)
try:
    with model.join():
        pass
except NotImplementedError as exc:
    print("join refused:", exc)
print("sharded followed:", gradsync.ShardedDataParallel(torch.nn.Linear(4, 4)).reducer.store.mirror)
bf16 = gradsync.ShardedDataParallel(torch.nn.Linear(4, 4).bfloat16(), reduce_dtype=torch.float32)
print("sharded bf16 followed:", bf16.reducer.store.mirror and bf16.reducer.attached is not None)
print("members", gradsync.elastic.members(), "events", gradsync.elastic.events())
"""


IN_A_THREAD = """
import threading, warnings, gradsync
def train():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gradsync.elastic.init_process_group("gloo", timeout=30)
    print("warned:", sum("ran outside the main thread, so it installs no signal handlers" in str(w.message)
                         for w in caught))
thread = threading.Thread(target=train)
thread.start()
thread.join()
"""


def test_elastic_init_outside_the_main_thread_says_it_installs_no_signal_handlers(tmp_path):
    """A framework that trains in a thread: SIGUSR1 killed the replica (exit -10) instead of stopping every replica at
    the same window end, without a word."""
    script = tmp_path / "thread.py"
    script.write_text(IN_A_THREAD)
    proc = run_cli(["run", str(script)], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "warned: 1" in proc.stdout, proc.stdout


def test_what_elastic_membership_cannot_recover_is_refused(tmp_path):
    """join() is refused; delay_all_reduce_named_params's parameters go into the buckets, where they commit with the
    rest; ShardedDataParallel follows membership, also with reduce_dtype (one replica: nothing to mirror yet)."""
    script = tmp_path / "refusals.py"
    script.write_text(REFUSALS)
    proc = run_cli(["run", str(script)], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "delayed in the buckets: True" in proc.stdout, proc.stdout
    assert "sharded followed: True" in proc.stdout and "sharded bf16 followed: True" in proc.stdout, proc.stdout
    assert "join refused: gradsync: join() is not supported on a model whose members may change" in proc.stdout
    assert "members [0] events []" in proc.stdout


def test_init_process_group_outside_gradsync_run_says_how_to_launch(monkeypatch):
    import gradsync
    monkeypatch.delenv("GRADSYNC_COORDINATOR", raising=False)
    with pytest.raises(RuntimeError, match="gradsync run --replicas"):
        gradsync.elastic.init_process_group("gloo")
    with pytest.raises(RuntimeError, match="init_process_group\\(\\) first"):
        gradsync.elastic.members()


def test_a_whole_machine_dies(tmp_path):
    """Three launchers share a coordinator, one replica each; replica 2 takes its launcher down with it,
    so no exit is reported: the survivors leave it out once its launcher's heartbeat stands still."""
    import socket
    from datetime import timedelta

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = ["run", "--machines", "3", "--replicas", "1", "--min-replicas", "2", "--coordinator",
            f"127.0.0.1:{port}", str(SCRIPT), "--out", str(tmp_path), "--windows", str(WINDOWS), "--steps",
            str(STEPS), "--victim", "2", "--window", "1", "--point", "during_reductions", "--kill-launcher"]
    procs = []
    try:
        for m in range(3):  # one at a time, so launcher 0 hosts the store and launcher 2 holds replica 2
            procs.append(ForkedCLI(argv))
            store = torch.distributed.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
            while store.add("gradsync/ids", 0) < m + 1:
                assert procs[-1].poll() is None, procs[-1].communicate()
                time.sleep(0.05)
            del store
        outputs = [p.communicate(timeout=150) for p in procs]
    finally:
        for p in procs:
            p.kill()
    codes = [p.returncode for p in procs]
    assert codes[:2] == [0, 0] and codes[2] == -9, (codes, outputs[0][1][-3000:])
    proc = subprocess.CompletedProcess(argv, 0, "", outputs[0][1] + outputs[1][1])
    results = check_run(tmp_path, proc, victim=2, window=1)
    # the heartbeat stood still 5 s; its last beat predates the kill by up to 0.5 s, and the failure is
    # seen here a little after the kill: a re-form driven by the heartbeat takes 4-5 s from that failure
    assert 4.0 <= results[0]["events"][0]["seconds"] < 30


def members_in(events: list[dict], window: int, replicas: int = 3) -> list[int]:
    members = set(range(replicas))
    for e in events:
        if e["window"] <= window:
            members = (members - set(e["left"])) | set(e["joined"])
    return sorted(members)


def dealt_to(events: list[dict], window: int, replicas: int = 3) -> list[int]:
    """The members a window is dealt to: after the changes of earlier windows and the joins before it."""
    members = set(range(replicas))
    for e in events:
        if e["window"] < window or (e["window"] == window and e["joined"]):
            members = (members - set(e["left"])) | set(e["joined"])
    return sorted(members)


def sampler_reference(events: list[dict], n: int, global_batch: int) -> tuple[list[torch.Tensor], list]:
    """One process on every micro-batch the sampler dealt, less those of a replica in the window it left in."""
    net, xs, ys = build_model(), *dataset(n)
    optimizer = make_optimizer(net.parameters())
    order, offset, w, lost = ElasticSampler(n, micro_batch=4, global_batch=global_batch, seed=3).order(0), 0, 0, []
    while offset + global_batch <= n:
        dealt = deal(order[offset:offset + global_batch], 4, dealt_to(events, w))
        gone = {r for e in events if e["window"] == w for r in e["left"]}
        lost += [(w, r, [i for mb in dealt[r] for i in mb]) for r in sorted(gone)]
        kept = [mb for r, mbs in dealt.items() if r not in gone for mb in mbs]
        loss = sum(torch.nn.functional.mse_loss(net(xs[mb]), ys[mb]) for mb in kept) / len(kept)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        offset, w = offset + global_batch, w + 1
    return [p.detach() for p in net.parameters()], lost


def test_sampler_global_batch_follows_a_shrink_and_a_join(tmp_path):
    """A constant global batch of 24 (6 micro-batches of 4) over 3, then 2, then 3 members: no sample
    twice, only the dead replica's micro-batches of its last window lost, and exactly the mean over
    what was kept, although members run 2 or 3 micro-steps per window."""
    n, gb = 2400, 24  # 100 windows: time for the restarted replica to rejoin, even on a loaded machine
    proc = launch(tmp_path, "--sampler", str(n), "--global-batch", str(gb), "--victim", "2", "--window", "3",
                  "--point", "during_reductions", "--sleep", "0.1", max_restarts=1)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = survivors(tmp_path)
    first = agreeing(results, [0, 1, 2], proc.stderr)
    events = first["events"]
    assert [(e["window"], e["left"], e["joined"]) for e in events][0] == (3, [2], [])
    assert [e["joined"] for e in events][1:] == [[2]]
    seen = [i for r in results.values() for _, idx in r["processed"] for i in idx]
    lost = [i for _, _, idx in first["lost"] for i in idx]
    assert len(seen) == len(set(seen)) and not set(seen) & set(lost)  # no sample twice in the epoch
    want, want_lost = sampler_reference(events, n, gb)
    assert [tuple(x) for x in first["lost"]] == [tuple(x) for x in want_lost] and len(lost) == 8
    for got, ref in zip(first["params"], want):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def one_process_deterministic(rank, world_size, events, n, global_batch):
    """gradsync's deterministic=True on one rank, window by window on the micro-batches that were kept (dealt in
    blocks to the 2 replicas), each loss / (micro-batches kept): the tree of the window's leaves."""
    import gradsync
    net, (xs, ys) = build_model(), dataset(n)
    model = gradsync.DistributedDataParallel(net, deterministic=True)
    optimizer = make_optimizer(model.parameters())
    order, offset, w = ElasticSampler(n, micro_batch=4, global_batch=global_batch, seed=3).order(0), 0, 0
    while offset + global_batch <= n:
        dealt = deal(order[offset:offset + global_batch], 4, dealt_to(events, w, replicas=2), blocks=True)
        gone = {r for e in events if e["window"] == w for r in e["left"]}
        kept = [mb for r, mbs in dealt.items() if r not in gone for mb in mbs]
        optimizer.zero_grad()
        for i, mb in enumerate(kept):
            with model.no_sync() if i < len(kept) - 1 else contextlib.nullcontext():
                (torch.nn.functional.mse_loss(model(xs[mb]), ys[mb]) / len(kept)).backward()
        optimizer.step()
        offset, w = offset + global_batch, w + 1
    return [p.detach() for p in net.parameters()]


@pytest.mark.parametrize("point", ["after_reductions", "forward", "local_backward"])
def test_deterministic_survivor_equals_one_process_on_what_was_kept_bit_for_bit(tmp_path, point):
    """deterministic=True with ElasticSampler(global_batch=16): 4 micro-batches a window, in blocks of 2 on
    2 replicas. Replica 1 dies at window 2's commit vote, in its last forward or in its first (no_sync) backward;
    the survivor runs all 4 from window 3 on. Its parameters equal, bit for bit, gradsync's deterministic run on
    one rank of exactly what was kept."""
    n, gb = 160, 16
    proc = launch(tmp_path, "--sampler", str(n), "--global-batch", str(gb), "--victim", "1", "--window", "2",
                  "--point", point, "--ddp", "deterministic=True", replicas=2, min_replicas=1)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (first,) = survivors(tmp_path).values()
    assert [(e["window"], e["left"]) for e in first["events"]] == [(2, [1])]
    from gradsync.tools.launch import run_ranks
    (want,) = run_ranks(one_process_deterministic, 1, first["events"], n, gb)
    assert all(torch.equal(got, ref) for got, ref in zip(first["params"], want))


def test_sampler_uneven_micro_steps_without_a_failure(tmp_path):
    """20 samples a window: 5 micro-batches of 4 dealt 2, 2, 1; the window is the mean over all 5."""
    proc = launch(tmp_path, "--sampler", "200", "--global-batch", "20")
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = survivors(tmp_path)
    assert sorted(results) == [0, 1, 2]
    counts = [len([1 for w, _ in results[r]["processed"] if w == 0]) for r in range(3)]
    assert counts == [2, 2, 1]
    want, _ = sampler_reference([], 200, 20)
    for r in range(3):
        for got, ref in zip(results[r]["params"], want):
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_a_new_replica_id_grows_the_job(tmp_path):
    """A second launcher reaches the coordinator after the job started: its replica gets a new id (2),
    joins at a window boundary, and the job goes on with three members, bit-identical."""
    import socket
    from datetime import timedelta

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    windows = 40

    def launcher(replicas: int) -> ForkedCLI:
        return ForkedCLI(["run", "--replicas", str(replicas), "--coordinator", f"127.0.0.1:{port}", str(SCRIPT),
                          "--out", str(tmp_path), "--windows", str(windows), "--steps", str(STEPS), "--sleep", "0.1",
                          "--until-full", "3"])

    procs = [launcher(2)]
    try:
        store = torch.distributed.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        store.wait(["gradsync/job/started"], timedelta(seconds=60))
        del store
        procs.append(launcher(1))
        outputs = [p.communicate(timeout=150) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    first = agreeing(survivors(tmp_path), [0, 1, 2])
    (event,) = first["events"]
    assert (event["generation"], event["left"], event["joined"]) == (1, [], [2]) and event["window"] > 0
    want = reference(first["events"], 3, windows=first["windows"], initial=2)
    for got, ref in zip(first["params"], want):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_a_joiner_admitted_right_after_a_loss_takes_the_same_lost_samples(monkeypatch):
    """A replica that rejoins at the first boundary after the one it died in gets the members' sampler state at
    that boundary: the losses must already be in it, since the joiner never saw the window they were dealt in
    (it recorded the loss with no samples, and the survivors disagreed with it, once restarts became fast)."""
    from types import SimpleNamespace

    from gradsync import process

    m = SimpleNamespace(members=[0, 1, 2], replica_id=0, events=[], registered={}, stopping=False)
    monkeypatch.setattr(process.state, "replica", m)
    acc = SimpleNamespace(windows=0, at_window_start=lambda: None, plan_window=lambda *a: None)
    member = ElasticSampler(240, micro_batch=4, seed=3, global_batch=24)
    micro_batches = member.iterate(acc)
    for w in range(4):  # 6 micro-batches a window, 2 of them replica 0's
        acc.windows = w
        next(micro_batches), next(micro_batches)
    m.events.append(SimpleNamespace(generation=1, window=3, left=[2], joined=[], committed=0))  # replica 2 died in window 3
    m.members = [0, 1]
    joiner = ElasticSampler(240, micro_batch=4, seed=3, global_batch=24)
    acc.at_window_start = lambda: joiner.load_state_dict(member.state_dict())  # admitted before window 4
    acc.windows = 4
    next(micro_batches)
    joiner._note_losses(m)  # as its own iterate() does first
    assert member.lost[0][:2] == (3, 2) and len(member.lost[0][2]) == 8  # its two micro-batches of window 3
    assert joiner.lost == member.lost


def test_check_replicas_evict_removes_a_corrupted_replica_and_it_rejoins(tmp_path):
    """Replica 2 flips one bit of a parameter at window 1's first micro-step. With check_replicas="evict" the
    window's synced backward finds it outside the majority: replicas 0 and 1 reduce the window again without
    it, replica 2 raises ReplicaMismatchError and exits, gradsync run restarts it and it rejoins with a peer's
    state. All three end bit-identical and equal to one process trained on what was kept."""
    windows = 40
    proc = launch(tmp_path, "--victim", "2", "--window", "1", "--point", "corrupt", "--check-replicas", "evict",
                  "--sleep", "0.1", "--until-full", "3", max_restarts=1, windows=windows)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "ReplicaMismatchError" in proc.stderr and "rank(s) [2] disagree with the majority" in proc.stderr
    first = agreeing(survivors(tmp_path), [0, 1, 2], proc.stderr)
    (left, joined) = first["events"]
    assert (left["generation"], left["window"], left["left"], left["joined"]) == (1, 1, [2], [])
    assert (joined["generation"], joined["left"], joined["joined"]) == (2, [], [2])
    want = reference(first["events"], 3, windows=first["windows"])
    for got, ref in zip(first["params"], want):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_check_replicas_without_evict_stops_every_replica(tmp_path):
    proc = launch(tmp_path, "--victim", "2", "--window", "1", "--point", "corrupt", "--check-replicas", "1")
    assert proc.returncode != 0
    assert "ReplicaMismatchError" in proc.stderr and "rank(s) [2] disagree with the majority" in proc.stderr
    assert survivors(tmp_path) == {}


@pytest.mark.slow  # 18 launches of 3 replicas; the compiled ones take a minute or two each
@pytest.mark.parametrize("option", sorted(OPTIONS) + ["overlap", "sharded", "auto", "compile"])
@pytest.mark.parametrize("point", ["forward", "local_backward"])
def test_kills_outside_the_reduction_with_every_option(tmp_path, option, point):
    """A replica SIGKILLed in the forward or the no_sync backward of its window's first micro-step, with each option
    of the matrix: the survivors close that window over their own micro-steps, as with the defaults."""
    extra = {"overlap": ["--overlap"], "sharded": ["--sharded"], "auto": AUTO, "compile": ["--compile"]}.get(option)
    proc = launch(tmp_path, "--victim", "2", "--window", "1", "--point", point, "--kill-step", "0",
                  *(OPTIONS[option] if extra is None else extra), timeout=400 if option == "compile" else 150.0)
    check_run(tmp_path, proc, victim=2, window=1, bf16=option == "bf16", adamw=option == "sharded",
              width=512 if option == "auto" else 16, spare=option == "skip_unused")


IN_PLACE = """
import torch, gradsync
gradsync.elastic.init_process_group("gloo", timeout=60)
class Scaled(torch.nn.Module):  # one buffer: alone in its broadcast chunk
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))
    def forward(self, x):
        return self.lin(x) * self.scale
model = gradsync.DistributedDataParallel(Scaled())
given, broadcast = [], torch.distributed.broadcast
def watched(tensor, *args, **kwargs):
    given.append(tensor.untyped_storage().data_ptr() == model.module.scale.untyped_storage().data_ptr())
    return broadcast(tensor, *args, **kwargs)
torch.distributed.broadcast = watched
for _ in range(2):
    model(torch.randn(2, 4)).sum().backward()
print(f"broadcasts {len(given)} into the buffer itself {any(given)} scale {model.module.scale.tolist()}", flush=True)
"""


def test_an_elastic_model_never_hands_a_buffer_itself_to_a_broadcast(tmp_path):
    """A member frozen in the old group can complete a collective the others left there once it is continued
    (gloo cannot cancel it): on an elastic model a buffer alone in its chunk is broadcast through a copy, which
    such a late write cannot reach (test_launchers.py's frozen drills show the same for the buckets)."""
    script = tmp_path / "in_place.py"
    script.write_text(IN_PLACE)
    proc = run_cli(["run", "--replicas", "2", str(script)], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("broadcasts 2 into the buffer itself False scale [1.0, 1.0, 1.0, 1.0]") == 2, proc.stdout


JOIN_IN_PLACE = """
import os, signal, time, torch, gradsync
gradsync.elastic.init_process_group("gloo", timeout=60)
me, restart = gradsync.elastic.replica_id(), int(os.environ["GRADSYNC_RESTART"])
torch.manual_seed(0)
net = torch.nn.Linear(4, 4, bias=False)  # one parameter: alone in its chunk of the state sent to a joiner
model = gradsync.DistributedDataParallel(net)
acc = gradsync.GradientAccumulator(model, steps=1)
optimizer = acc.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
given, broadcast = [], torch.distributed.broadcast
def watched(tensor, *args, **kwargs):
    given.append(tensor.untyped_storage().data_ptr() == net.weight.untyped_storage().data_ptr())
    return broadcast(tensor, *args, **kwargs)
torch.distributed.broadcast = watched
joined = lambda: any(e.joined for e in gradsync.elastic.events())
while not (acc.is_boundary and acc.windows >= 4 and len(gradsync.elastic.members()) == 2 and joined()):
    time.sleep(0.02)
    with acc.accumulate():  # the restarted replica joins here
        acc.backward(model(torch.ones(2, 4)).sum())
    optimizer.step()
    optimizer.zero_grad()
    if me == 1 and restart == 0 and acc.windows == 2:
        os.kill(os.getpid(), signal.SIGKILL)
print(f"replica {me} restart {restart}: {len(given)} broadcasts, into the parameter itself {any(given)}, "
      f"weight {net.weight.sum().item():.6f}", flush=True)
"""


def test_the_state_sent_to_a_joiner_never_reaches_a_parameter_itself(tmp_path):
    """A member frozen while it sends the state to a joiner, left out and then continued, can complete that broadcast
    late (gloo cannot cancel it): the parameters travel through a copy, which such a late write cannot reach."""
    script = tmp_path / "join_in_place.py"
    script.write_text(JOIN_IN_PLACE)
    proc = run_cli(["run", "--replicas", "2", "--min-replicas", "1", "--max-restarts", "1", str(script)], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("replica "))
    assert [line.split(":")[0] for line in lines] == ["replica 0 restart 0", "replica 1 restart 1"], proc.stdout
    assert all("into the parameter itself False" in line for line in lines), lines
    assert len({line.split("weight ")[1] for line in lines}) == 1, lines  # the joiner took the member's parameters
