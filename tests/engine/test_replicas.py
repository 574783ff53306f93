"""check_replicas=True: a flipped bit in one rank's parameters, reduced gradient or optimizer state is caught
on every rank, with the rank named (engine/replicas.py)."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import gradsync
from gradsync.engine.replicas import disagreeing, fingerprint
from helpers import cpu_hogs, mlp, run_ranks


def flip(t: torch.Tensor, index: int = 0, bit: int = 3) -> None:
    """Flip one bit of ``t``'s memory in place (its ``index``-th byte)."""
    with torch.no_grad():
        t.detach().reshape(-1).view(torch.uint8)[index] ^= 1 << bit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16])
@pytest.mark.parametrize("numel", [1, 7, 8, 33, 70_001])
def test_any_single_flipped_bit_changes_the_fingerprint(dtype, numel):
    g = torch.Generator().manual_seed(numel)
    base = torch.randn(numel + 3, generator=g).to(dtype)
    for offset in (0, 1, 3):  # views that start off an 8-byte boundary
        t = base[offset:offset + numel].clone() if offset == 0 else base[offset:offset + numel]
        before = fingerprint([t])
        assert fingerprint([t.clone()]) == before  # the same bits give the same sum
        nbytes = t.numel() * t.element_size()
        for index in sorted({0, nbytes // 2, nbytes - 1}):
            for bit in (0, 5, 7):
                flip(t, index, bit)
                assert fingerprint([t]) != before, (offset, index, bit)
                flip(t, index, bit)
        assert fingerprint([t]) == before


def test_a_fingerprint_of_many_tensors_is_their_words_summed_in_any_grouping():
    g = torch.Generator().manual_seed(0)
    small = [torch.randn(n, generator=g) for n in (2, 5, 64, 1000)]
    big = [torch.randn(1 << 17, generator=g)]
    whole = fingerprint(small + big)
    assert whole == fingerprint(big + small[::-1])
    assert whole == torch.stack([fingerprint([t]) for t in small + big]).sum()  # int64 sums wrap the same way


def test_the_ranks_outside_the_majority_are_named():
    assert disagreeing({0: [1, 2], 1: [1, 2], 2: [1, 9]}, 2) == ([1], {2})
    assert disagreeing({0: [5], 1: [6]}, 1) == ([0], {0, 1})  # two ranks: no majority
    assert disagreeing({0: [5], 1: [6], 2: [7]}, 1) == ([0], {0, 1, 2})
    assert disagreeing({0: [5], 1: [5]}, 1) == ([], set())


def train(rank, world_size, steps, fault=None, at=3, culprit=None, check=True, hook=False, load=False, device="cpu"):
    """AdamW on an mlp; at step ``at`` rank ``culprit`` suffers ``fault``. Return (steps done, error type,
    message, parameters)."""
    torch.manual_seed(0)
    culprit = world_size - 1 if culprit is None else culprit
    model = gradsync.DistributedDataParallel(mlp().to(device), bucket_cap_mb=4e-3, first_bucket_cap_mb=4e-3,
                                             check_replicas=check)
    calls = [0]
    if hook:  # an all-reduce hook that corrupts one reduced bucket on the culprit at step ``at``
        def corrupting(state, bucket):
            fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
            def average(f):
                out = f.value()[0].div_(world_size)
                if fault == "gradient" and rank == culprit and calls[0] == at * len(model.reducer.buckets):
                    flip(out, 1, 6)
                calls[0] += 1
                return out
            return fut.then(average)
        model.register_comm_hook(None, corrupting)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    done = 0
    try:
        for step in range(steps):
            if rank == culprit and step == at:
                if fault == "parameter":
                    flip(model.module[2].weight, 9, 2)
                elif fault == "state":
                    flip(opt.state[model.module[0].bias]["exp_avg"], 2, 1)
            x = torch.randn(6, 8, generator=g).to(device)
            F.mse_loss(model(x), x[:, :4]).backward()
            opt.step()
            opt.zero_grad()
            done = step + 1
    except gradsync.SyncError as exc:
        return done, type(exc).__name__, str(exc), None
    return done, None, None, {n: p.detach().cpu() for n, p in model.module.named_parameters()}


def test_clean_training_raises_nothing_and_is_bit_identical_to_unchecked():
    checked = run_ranks(train, 3, 12)
    unchecked = run_ranks(train, 3, 12, None, 3, None, False)
    for (done, error, _, params), (_, _, _, ref) in zip(checked, unchecked):
        assert done == 12 and error is None
        assert all(torch.equal(params[n], ref[n]) for n in ref)


@pytest.mark.parametrize("fault,hook", [("parameter", False), ("gradient", True), ("state", False)])
def test_a_flipped_bit_on_one_rank_of_three_is_caught_within_two_steps_on_every_rank(fault, hook):
    results = run_ranks(train, 3, 10, fault, 3, 2, True, hook, timeout=120)
    for done, error, message, _ in results:
        assert error == "ReplicaMismatchError", (fault, done, message)
        assert 3 <= done <= 5, (fault, done)  # at most two optimizer steps after the fault
        assert "rank(s) [2] disagree with the majority of ranks [0, 1, 2]" in message, message
    assert len({r[:3] for r in results}) == 1  # the same error on every rank, at the same step


def test_with_two_ranks_both_are_named_with_the_bucket_and_parameter():
    results = run_ranks(train, 2, 8, "parameter", 2, 1)
    for done, error, message, _ in results:
        assert error == "ReplicaMismatchError" and done == 2, (done, message)
        assert "ranks [0, 1] disagree and no majority can tell which is right" in message
        assert "'2.weight'" in message and "bucket(s) [" in message


def test_a_rank_that_joined_takes_part_without_a_mismatch():
    def fn(rank, world_size):
        model = gradsync.DistributedDataParallel(mlp(), check_replicas=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with model.join():
            for _ in range(3 + 2 * rank):  # uneven inputs: rank 0 joins early and shadows
                model(torch.ones(2, 8)).sum().backward()
                opt.step()
                opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]
    a, b = run_ranks(fn, 2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_check_replicas_takes_a_bool_or_evict_and_evict_only_in_an_elastic_job():
    def fn(rank, world_size):
        with pytest.raises(TypeError, match='check_replicas must be True, False or "evict"'):
            gradsync.DistributedDataParallel(mlp(), check_replicas="yes")
        with pytest.raises(ValueError, match="this model is not in one: call gradsync.elastic.init_process_group"):
            gradsync.DistributedDataParallel(mlp(), check_replicas="evict")
    run_ranks(fn, 2)


def test_thirty_steps_beside_two_cpu_bound_processes_raise_nothing():
    with cpu_hogs(2):
        results = run_ranks(train, 3, 30, timeout=300)
    assert all(done == 30 and error is None for done, error, _, _ in results)


@pytest.mark.slow
def test_ten_thousand_clean_steps_raise_nothing():
    results = run_ranks(train, 3, 10_000, timeout=3000)
    assert all(done == 10_000 and error is None for done, error, _, _ in results)


def options_run(rank, world_size, option, steps, flip_at):
    """Train ``steps`` windows of 2 micro-steps with ``option``; rank 1 flips a parameter bit at ``flip_at``."""
    torch.manual_seed(0)
    kwargs = {"views": dict(gradient_as_bucket_view=True), "reduce_dtype": dict(reduce_dtype=torch.float32),
              "unused": dict(find_unused_parameters=True, skip_all_reduce_unused_params=True),
              "auto": dict(bucket_cap_mb="auto"), "static": dict(static_graph=True)}.get(option, {})
    net = mlp(dtype=torch.bfloat16 if option == "reduce_dtype" else torch.float32)
    wrapper = gradsync.ShardedDataParallel if option == "sharded" else gradsync.DistributedDataParallel
    model = wrapper(net, bucket_cap_mb=kwargs.pop("bucket_cap_mb", 4e-3), check_replicas=True, **kwargs)
    if option == "bf16_hook":
        model.register_comm_hook(None, gradsync.bf16_compress_hook)
    acc = gradsync.GradientAccumulator(model, steps=2)
    opt = gradsync.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-3) if option == "sharded" else \
        torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = acc.wrap_optimizer(opt)
    g = torch.Generator().manual_seed(rank)
    for step in range(steps):
        if rank == 1 and step == flip_at:
            flip(net[2].weight, 5, 4)
        for _ in range(2):
            with acc.accumulate():
                x = torch.randn(6, 8, generator=g).to(net[0].weight.dtype)
                try:
                    acc.backward(F.mse_loss(model(x), x[:, :4]))
                except gradsync.ReplicaMismatchError as exc:
                    return step, str(exc)
                opt.step()
                opt.zero_grad()
    return steps, None


@pytest.mark.parametrize("option", ["views", "reduce_dtype", "sharded", "unused", "bf16_hook", "auto", "static"])
def test_every_option_trains_clean_and_catches_a_flipped_parameter(option):
    clean = run_ranks(options_run, 3, option, 20 if option == "auto" else 5, -1, timeout=120)
    assert all(r == (20 if option == "auto" else 5, None) for r in clean), clean
    caught = run_ranks(options_run, 3, option, 6, 3, timeout=120)
    for step, message in caught:
        assert step == 3 and "rank(s) [1] disagree" in message and "'2.weight'" in message, (step, message)


class Branch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.extra = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4), torch.nn.Linear(16, 4)

    def forward(self, x, use):
        h = torch.tanh(self.a(x))
        return self.b(h) + self.extra(h) if use else self.b(h)


def skipped_then_used(rank, world_size, check):
    net = Branch()
    model = gradsync.DDP(net, find_unused_parameters=True, skip_all_reduce_unused_params=True, bucket_cap_mb=0.0001,
                         check_replicas=check)
    opt, g = torch.optim.SGD(model.parameters(), lr=0.1), torch.Generator().manual_seed(rank)
    for step in range(6):
        x = torch.randn(6, 8, generator=g)
        F.mse_loss(model(x, step == 3 and rank == 0), x[:, :4]).backward()  # no rank used it, then rank 0 does
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in net.parameters()]


def test_a_skipped_bucket_reduced_late_is_fingerprinted_after_its_reduction():
    # it used to be fingerprinted as this rank's unreduced buffer: a healthy rank was named the next step
    checked, plain = run_ranks(skipped_then_used, 3, True), run_ranks(skipped_then_used, 3, False)
    for ours, theirs in zip(checked, plain):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def in_a_subgroup(rank, world_size):
    """Global ranks 1-3 train one model in their own group; global rank 3's parameter is flipped."""
    group = dist.new_group([1, 2, 3])
    if rank == 0:
        return None
    model = gradsync.DDP(mlp(seed=0), process_group=group, check_replicas=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for step in range(4):
            torch.manual_seed(step * 10 + rank)
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if step == 1 and rank == 3:
                flip(model.module[0].weight)
    except gradsync.ReplicaMismatchError as exc:
        return str(exc)


def test_a_subgroups_mismatch_names_the_global_rank_whose_host_to_check():
    """The message said 'rank(s) [2]', the group's position: the advice to check that rank's host sent the user to
    global rank 2, a healthy one."""
    for message in run_ranks(in_a_subgroup, 4, timeout=120)[1:]:
        assert "rank(s) [2] disagree" in message and "global rank(s) [3]" in message, message
