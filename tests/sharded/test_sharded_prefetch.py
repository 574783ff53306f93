"""ShardedOptimizer(prefetch=True): all-gathers waited at a parameter's first use after step()."""
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradsync
from gradsync.tools.launch import run_ranks
from helpers import assert_close_dicts, batches, params, shard
from test_sharded import CAPS, K, model, window


def adamw(m, prefetch):
    return gradsync.ShardedOptimizer(m, torch.optim.AdamW, lr=0.01, weight_decay=0.1, prefetch=prefetch)


def stack_depth():
    return torch._C._len_torch_function_stack()


def train(rank, world_size, how):
    """prefetch=True, prefetch=False and torch's DDP + AdamW, window by window in one process group."""
    nets = [gradsync.ShardedDataParallel(model(seed=rank), **CAPS) for _ in range(2)]
    theirs = nn.parallel.DistributedDataParallel(model(seed=rank))
    opts = [adamw(nets[0], True), adamw(nets[1], False), torch.optim.AdamW(theirs.parameters(), lr=0.01,
                                                                           weight_decay=0.1)]
    windows = 3
    data = batches(windows * K, world_size, per_rank=4)
    deferred = []
    for w in range(windows):
        window(w, data, rank, world_size, [(nets[0], how), (nets[1], how), (theirs, "no_sync")])
        for opt in opts:
            opt.step()
            opt.zero_grad()
        deferred.append((len(opts[0].pending_gathers), opts[1].pending_gathers))
    nbuckets = len(nets[0].reducer.buckets)
    after = params(nets[0].module)  # waits for the last step's all-gathers
    return after, params(nets[1].module), params(theirs.module), deferred, nbuckets, stack_depth()


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("how", ["no_sync", "sync_each_batch"])
def test_training_matches_torch_and_prefetch_false_bit_for_bit(world_size, how):
    for ours, plain, theirs, deferred, nbuckets, depth in run_ranks(train, world_size, how, timeout=90):
        for name in ours:
            assert torch.equal(ours[name], plain[name]), name
        assert_close_dicts(ours, theirs, atol=1e-5)
        assert nbuckets > 2
        # zero_grad() waits for nothing: every bucket was still pending after step() and zero_grad()
        assert deferred == [(nbuckets, [])] * 3
        assert depth == 1  # the mode stays until the next forward, step() or wait_for_params()


class OutOfOrder(nn.Module):
    """Reads ``mid``'s weight before running ``first``: not the order of the buckets."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.first, self.mid, self.last = nn.Linear(8, 33), nn.Linear(33, 33), nn.Linear(33, 4)

    def forward(self, x):
        skip = F.linear(x, self.mid.weight[:4, :8])
        h = torch.tanh(self.mid(torch.tanh(self.first(x))))
        return self.last(h) + skip


def out_of_order(rank, world_size):
    caps = dict(bucket_cap_mb=0.0005, first_bucket_cap_mb=0.0005)  # a bucket per layer
    nets = [gradsync.ShardedDataParallel(OutOfOrder(seed=rank), **caps) for _ in range(2)]
    opts = [adamw(nets[0], True), adamw(nets[1], False)]
    reducer = nets[0].reducer
    waited = []
    gathers = reducer.store.gathers
    wait_bucket = gathers.wait_bucket
    gathers.wait_bucket = lambda i: (waited.append(i), wait_bucket(i))
    mid = reducer.store.bucket_of[[id(p) for p in reducer.params].index(id(nets[0].module.mid.weight))]
    data = batches(3, world_size, per_rank=4)
    results = []
    for x, y in data:
        xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
        for net, opt in zip(nets, opts):
            F.mse_loss(net(xs), ys).backward()
            opt.step()
            opt.zero_grad()
        pending = opts[0].pending_gathers
        waited.clear()
        outs = [net(xs) for net in nets]
        results.append((pending, list(waited), torch.equal(*outs), opts[0].pending_gathers, stack_depth()))
    return results, mid, len(reducer.buckets)


def test_out_of_order_first_use_waits_only_what_it_reads():
    for results, mid, nbuckets in run_ranks(out_of_order, 2, timeout=60):
        assert nbuckets >= 3 and mid not in (0, nbuckets - 1)  # the forward's first read is a middle bucket
        for pending, waited, equal, after, depth in results:
            assert pending == list(range(nbuckets))  # step() waited for nothing
            assert waited[0] == mid and sorted(waited) == list(range(nbuckets))
            assert equal  # bit for bit the prefetch=False forward
            assert after == [] and depth == 0  # all waited, the mode popped, at the forward's end


READS = {
    "state_dict": lambda m, views: [t.clone() for t in m.module.state_dict().values()],
    "detach_clone": lambda m, views: [p.detach().clone() for p in m.module.parameters()],
    "sum": lambda m, views: [p.sum() for p in m.module.parameters()],
    "data": lambda m, views: [p.data.clone() for p in m.module.parameters()],
    "old_views": lambda m, views: [torch.cat(views)],  # views taken before step(), in a list argument
    "flat": lambda m, views: [b.flat_param * 1 for b in m.reducer.buckets],
}


def reads_after_step(rank, world_size):
    nets = [gradsync.ShardedDataParallel(model(seed=rank), **CAPS) for _ in range(2)]
    opts = [adamw(nets[0], True), adamw(nets[1], False)]
    views = [[p.view(-1) for p in net.module.parameters()] for net in nets]
    data = batches(len(READS), world_size, per_rank=4)
    out = {}
    for (name, read), (x, y) in zip(READS.items(), data):
        for net, opt in zip(nets, opts):
            F.mse_loss(net(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
            opt.step()
        pending = opts[0].pending_gathers
        got = [read(net, v) for net, v in zip(nets, views)]
        out[name] = (pending, all(torch.equal(a, b) for a, b in zip(*got)), opts[0].pending_gathers)
        for opt in opts:
            opt.zero_grad()
    # metadata does not wait; wait_for_params() waits for everything and pops the mode
    nets[0](shard(data[0][0], rank, world_size)).sum().backward()
    opts[0].step()
    meta = [(p.shape, p.dtype, p.requires_grad, p.grad, p.device) for p in nets[0].module.parameters()]
    still = opts[0].pending_gathers
    depth = stack_depth()
    opts[0].wait_for_params()
    return out, len(nets[0].reducer.buckets), len(meta), still, depth, opts[0].pending_gathers, stack_depth()


def test_reads_outside_forward_see_the_gathered_parameters():
    for out, nbuckets, _, still, depth, after, depth_after in run_ranks(reads_after_step, 3, timeout=60):
        for name, (pending, equal, left) in out.items():
            assert pending == list(range(nbuckets)), name
            assert equal, name
            assert left == [], name  # every read above touches every bucket
        assert still == list(range(nbuckets)) and depth == 1
        assert after == [] and depth_after == 0


def forward_on_a_thread(rank, world_size):
    """A forward on a thread without the mode waits for everything first."""
    nets = [gradsync.ShardedDataParallel(model(seed=rank), **CAPS) for _ in range(2)]
    opts = [adamw(nets[0], True), adamw(nets[1], False)]
    x, y = batches(1, world_size, per_rank=4)[0]
    xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
    for net, opt in zip(nets, opts):
        F.mse_loss(net(xs), ys).backward()
        opt.step()
    outs = []
    thread = threading.Thread(target=lambda: outs.append(nets[0](xs)))
    thread.start()
    thread.join()
    left, depth = opts[0].pending_gathers, stack_depth()
    opts[0].zero_grad()
    opts[1].zero_grad()
    F.mse_loss(nets[0](xs), ys).backward()  # the main thread's forward pops the stale mode
    return torch.equal(outs[0], nets[1](xs)), left, depth, stack_depth()


def test_forward_on_another_thread_waits_for_everything():
    for equal, left, depth, depth_after in run_ranks(forward_on_a_thread, 2, timeout=60):
        assert equal and left == [] and depth == 1 and depth_after == 0


def bad_prefetch(rank, world_size):
    net = gradsync.ShardedDataParallel(model(seed=0), **CAPS)
    errors = []
    for value in (1, "yes", None):
        with pytest.raises(TypeError, match="prefetch must be True or False") as info:
            adamw(net, value)
        errors.append(str(info.value))
    opt = adamw(net, True)  # one rank: nothing to gather, nothing deferred
    F.mse_loss(net(torch.randn(4, 8)), torch.randn(4, 4)).backward()
    opt.step()
    return errors, opt.pending_gathers, stack_depth()


def test_prefetch_takes_only_a_bool():
    errors, pending, depth = run_ranks(bad_prefetch, 1)[0]
    assert "int 1" in errors[0] and "str 'yes'" in errors[1]
    assert pending == [] and depth == 0
