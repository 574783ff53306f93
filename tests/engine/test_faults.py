"""Dead, stuck and diverging ranks: the survivors get a clear gradsync error within the bound."""
import os
import re
import signal
import time

import pytest
import torch

import gradsync
from gradsync.tools.launch import RankError
from helpers import SLACK, TIMEOUT, Normed, batches, faults, mlp, outcome, shard, shard_backward


def make(buffers=False, **kw):
    return gradsync.DDP(Normed() if buffers else mlp(), timeout=TIMEOUT, **kw)


def wait_for(flag):
    """Stay alive, neither finishing nor dying, until the other rank is done (at most 60 s)."""
    deadline = time.monotonic() + 60
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.05)


def outcome_then_flag(fn, flag):
    """``outcome(fn)``, then let the waiting rank go."""
    try:
        return outcome(fn)
    finally:
        open(flag, "w").close()


# ---------------------------------------------------------------- diverging ranks
def diverge(rank, world_size, how, buffers):
    model = make(buffers)
    data = batches(4, world_size)

    def loop():
        for i, (x, y) in enumerate(data):
            if rank == 1 and i == 1 and how == "no_sync":
                with model.no_sync():
                    shard_backward(model, rank, world_size, x, y)
            elif rank == 1 and i == 1 and how == "skip_backward":
                model(shard(x, rank, world_size))  # e.g. "if not loss.isfinite(): continue"
            elif how == "micro_steps":  # windows of 2 micro-steps on rank 0, 3 on rank 1
                with model.no_sync():
                    for _ in range(1 + rank):
                        shard_backward(model, rank, world_size, x, y)
                shard_backward(model, rank, world_size, x, y)
            else:
                shard_backward(model, rank, world_size, x, y)
    return outcome(loop)


@pytest.mark.parametrize("buffers", [False, True], ids=["no_buffers", "buffers"])
@pytest.mark.parametrize("how", ["no_sync", "skip_backward", "micro_steps"])
def test_diverging_ranks_raise_on_every_rank(how, buffers):
    for rank, (kind, message, seconds) in enumerate(faults(diverge, how, buffers)):
        assert kind == "SyncError", (rank, kind, message)
        # the phase headers pair whatever each rank is doing: an exact diagnosis, no timeout
        assert seconds < SLACK, (rank, seconds)
        assert "the ranks are out of step" in message, message
        assert re.search(r"rank 0 (is finishing backward|started forward) \d+", message), message
        assert re.search(r"rank 1 (is finishing backward|started forward) \d+", message), message
        print(f"\n[measured] {how}/{'buffers' if buffers else 'no_buffers'} rank {rank}: {seconds:.2f}s")


# ---------------------------------------------------------------- dead and stuck ranks
def killed(rank, world_size, where):
    model = make()
    x, y = batches(1, world_size)[0]
    if rank == 1:
        target = model.module[0].weight
        if where == "post_accumulate_grad_hook":
            target.register_post_accumulate_grad_hook(lambda p: os._exit(3))
        else:
            model.module[0].register_full_backward_hook(
                lambda *a: os.kill(os.getpid(), signal.SIGKILL))
    return outcome(lambda: shard_backward(model, rank, world_size, x, y))


@pytest.mark.parametrize("where", ["post_accumulate_grad_hook", "module_backward_hook"])
def test_rank_killed_mid_backward(where):
    survivor, dead = faults(killed, where)
    assert isinstance(dead, RankError) and ("died" in str(dead) or "without a result" in str(dead))
    kind, message, seconds = survivor
    # small buckets may all finish before the peer dies; then the end-of-backward check notices
    assert kind == "SyncError", message
    assert re.search(r"rank 0 waited for (bucket \d+|the end-of-backward check|the phase header)", message), message
    assert "another rank died" in message
    assert seconds < TIMEOUT + SLACK
    print(f"\n[measured] killed in {where}: {seconds:.2f}s")


def stuck_after_raising(rank, world_size, flag):
    """Rank 1 raises in forward but its process stays alive: no connection reset helps rank 0."""
    model = make()
    x, y = batches(1, world_size)[0]
    if rank == 1:
        with pytest.raises(ValueError, match="bad batch"):
            model.module.register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(ValueError("bad batch")))
            model(shard(x, rank, world_size))
        wait_for(flag)
        return None
    return outcome_then_flag(lambda: shard_backward(model, rank, world_size, x, y), flag)


def test_rank_raising_in_forward_does_not_hang_the_others(tmp_path):
    survivor, other = faults(stuck_after_raising, str(tmp_path / "done"))
    assert other is None
    kind, message, seconds = survivor
    assert kind == "SyncError" and f"did not finish within {TIMEOUT:g}s" in message, message
    assert "the phase header of synced backward 0" in message
    assert TIMEOUT - 0.2 < seconds < TIMEOUT + SLACK
    print(f"\n[measured] raise in forward (rank alive): {seconds:.2f}s")


def late_constructor(rank, world_size, flag):
    if rank == 1:  # never wraps its model
        wait_for(flag)
        return None
    return outcome_then_flag(make, flag)


def test_construction_is_bounded(tmp_path):
    (kind, message, seconds), _ = faults(late_constructor, str(tmp_path / "done"))
    assert kind == "SyncError" and "construct DistributedDataParallel" in message, message
    assert seconds < TIMEOUT + SLACK
    print(f"\n[measured] peer never constructs: {seconds:.2f}s")


def after_destroy(rank, world_size):
    import torch.distributed as dist
    model = make(buffers=True)
    dist.destroy_process_group()
    return outcome(lambda: model(torch.randn(4, 8)).sum().backward())


def test_model_called_after_the_group_was_destroyed():
    for kind, message, seconds in faults(after_destroy):
        assert kind == "RuntimeError" and "process group was destroyed" in message, message
        assert seconds < 1
