"""deterministic=True (issue 40): the same windows on W = 1, 2, 4, 8 give the same parameter bits after every step.

The window's global micro-batch j runs on rank j // k as its micro-step j % k (k = micro-batches / W). The
model has attention, LayerNorm and GELU; the optimizers SGD with momentum and AdamW; the losses a mean
and a sum with ``num_items`` (uneven item counts). Every step's parameters are hashed (SHA-256) on every rank.
"""
import hashlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradsync
from gradsync.deterministic import TreeSum, tree_sum
from gradsync.tools.launch import run_ranks

GLOBAL, WINDOWS, ROWS = 8, 3, 4  # 8 global micro-batches a window


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(6, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 3))

    def forward(self, x):
        h = self.embed(x)
        h = self.norm(h + self.attn(h, h, h, need_weights=False)[0])
        return self.head(h).mean(1)


def windows():
    g = torch.Generator().manual_seed(1)
    return [[(torch.randn(ROWS, 5, 6, generator=g), torch.randn(ROWS, 3, generator=g), 1 + j % 3)
             for j in range(GLOBAL)] for _ in range(WINDOWS)]


def digest(net):
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in net.parameters())).hexdigest()


def train(rank, world_size, optimizer, mode, deterministic=True, views=False, each=False):
    net = Block()
    model = gradsync.DDP(net, deterministic=deterministic, bucket_cap_mb=0.005, first_bucket_cap_mb=0.001,
                         gradient_as_bucket_view=views)
    k = GLOBAL // world_size
    acc = gradsync.GradientAccumulator(model, steps=k, sync_each_batch=each)
    opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if optimizer == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=1e-2))
    opt = acc.wrap_optimizer(opt)
    hashes = []
    for window in windows():
        # global micro-batch j on rank j // k; with sync_each_batch on rank j % W
        for x, y, n in (window[rank::world_size] if each else window[rank * k:(rank + 1) * k]):
            with acc.accumulate():
                out = model(x)
                if mode == "mean":
                    acc.backward(F.mse_loss(out, y))
                else:
                    acc.backward(F.mse_loss(out[:n], y[:n], reduction="sum"), num_items=n)
        opt.step()
        opt.zero_grad(set_to_none=not views)  # with views, .grad stays the bucket's slot, zeroed
        hashes.append(digest(net))
    return hashes


@pytest.mark.parametrize("optimizer,mode,views", [("sgd", "mean", False), ("adamw", "items", False),
                                                  ("sgd", "items", True)])
def test_every_step_is_bit_identical_on_1_2_4_and_8_ranks(optimizer, mode, views):
    runs = {w: run_ranks(train, w, optimizer, mode, True, views, timeout=120) for w in (1, 2, 4, 8)}
    for w, ranks in runs.items():
        assert all(r == ranks[0] for r in ranks), f"W={w}: the ranks differ"
    assert runs[1][0] == runs[2][0] == runs[4][0] == runs[8][0]


def test_the_tree_of_blocks_is_the_tree_of_leaves():
    """A rank's micro-steps summed by their own TreeSum, then the ranks' sums by another: one TreeSum over
    every leaf, bit for bit, for blocks of 2^a leaves (and a sequential sum is not that)."""
    g = torch.Generator().manual_seed(3)
    leaves = [torch.randn(1000, generator=g) * 10 ** float(torch.randint(-3, 4, (1,), generator=g)) for _ in range(16)]
    whole = tree_sum(leaves)
    for block in (1, 2, 4, 8):
        sums = [tree_sum(leaves[i:i + block]) for i in range(0, 16, block)]
        assert torch.equal(tree_sum(sums), whole)
    chain = leaves[0].clone()
    for leaf in leaves[1:]:
        chain += leaf
    assert not torch.equal(chain, whole)  # the order matters at these magnitudes: the test can tell
    tree = TreeSum()
    for leaf in leaves[:5]:
        tree.push(leaf.clone())
    assert [h for h, _ in tree.nodes] == [2, 0] and torch.equal(tree.total(), tree_sum(leaves[:5]))


def refused(rank, world_size, what):
    from helpers import outcome

    def build():
        net = nn.Linear(4, 4)
        if what == "hook":
            gradsync.DDP(net, deterministic=True).register_comm_hook(None, gradsync.hooks.allreduce_hook)
        elif what == "join":
            with gradsync.DDP(net, deterministic=True).join():
                pass
        else:
            gradsync.DDP(net, deterministic=True, reduce_dtype=torch.float32)
    return outcome(build)


@pytest.mark.parametrize("what", ["hook", "reduce_dtype", "join"])
def test_what_would_change_the_order_is_refused(what):
    for kind, message, _ in run_ranks(refused, 2, what):
        assert kind == ("NotImplementedError" if what == "join" else "ValueError"), message
        assert "deterministic=True" in message, message


@pytest.mark.parametrize("optimizer,mode,views", [("sgd", "mean", False), ("adamw", "items", True)])
def test_sync_each_batch_is_the_same_tree(optimizer, mode, views):
    """Each micro-step reduced before the next (micro-batch j on rank j % W): every step's parameters equal those
    of one process without sync_each_batch, bit for bit, on 1, 2 and 4 ranks."""
    one = run_ranks(train, 1, optimizer, mode, True, views, False)[0]
    for w in (1, 2, 4):
        for r, hashes in enumerate(run_ranks(train, w, optimizer, mode, True, views, True, timeout=120)):
            assert hashes == one, f"W={w}, rank {r}: differs from one process from step {next(i for i, (a, b) in enumerate(zip(hashes, one)) if a != b)}"


def resumed(rank, world_size, interrupt, each=False):
    """One window of 4 micro-steps per rank; with ``interrupt``, a checkpoint after micro-step 2 is loaded into
    a fresh model (and optimizer) that finishes the window."""
    net = Block()
    model = gradsync.DDP(net, deterministic=True)
    acc = gradsync.GradientAccumulator(model, steps=4, sync_each_batch=each)
    window = windows()[0]
    for i, (x, y, _) in enumerate(window[rank::world_size] if each else window[rank * 4:(rank + 1) * 4]):
        if interrupt and i == 2:
            saved = (net.state_dict(), model.grad_state_dict(), acc.state_dict())
            net = Block()
            model = gradsync.DDP(net, deterministic=True)
            acc = gradsync.GradientAccumulator(model, steps=4, sync_each_batch=each)
            net.load_state_dict(saved[0])
            model.load_grad_state_dict(saved[1])
            acc.load_state_dict(saved[2])
        with acc.accumulate():
            acc.backward(F.mse_loss(model(x), y))
    return [p.grad.clone() for p in net.parameters()]


@pytest.mark.parametrize("each", [False, True])
def test_a_mid_window_checkpoint_keeps_the_tree(each):
    """grad_state_dict() carries the window's trees (``.grad`` is None inside a deterministic window), and with
    sync_each_batch the tree of the micro-steps' reductions (``.grad`` holds only its total)."""
    plain, restored = run_ranks(resumed, 2, False, each), run_ranks(resumed, 2, True, each)
    for a, b in zip(plain, restored):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


class Branched(nn.Module):
    """A branch only some global micro-batches use (find_unused_parameters=True)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.branch = nn.Linear(6, 3), nn.Linear(6, 3)

    def forward(self, x, use):
        return self.a(x) + self.branch(x) if use else self.a(x)


USES = {0, 3, 6}  # the global micro-batches that reach the branch


def branched(rank, world_size, each, overlap, unused):
    net = Branched()
    model = gradsync.DDP(net, deterministic=True, find_unused_parameters=unused) if world_size else net
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    if overlap:
        gradsync.overlap_optimizer(model, opt)
    k = GLOBAL // max(world_size, 1)
    acc = gradsync.GradientAccumulator(model, steps=k, sync_each_batch=each) if world_size else None
    steps = []
    for window in windows():
        mine = list(enumerate(window))[rank::world_size] if each else list(enumerate(window))[rank * k:(rank + 1) * k]
        for j, (x, y, _) in (mine if world_size else enumerate(window)):
            x = x.mean(1)
            if acc is None:  # one process, the plain loop: the mean over the window's micro-batches
                (F.mse_loss(net(x, j in USES or not unused), y) / GLOBAL).backward()
                continue
            with acc.accumulate():
                acc.backward(F.mse_loss(model(x, j in USES or not unused), y))
                if overlap:
                    acc.wrap_optimizer(opt).step()
        if not overlap:
            opt.step()
        opt.zero_grad()
        steps.append([p.detach().clone() for p in net.parameters()])
    return steps


@pytest.mark.parametrize("unused,overlap", [(True, False), (False, True)], ids=["find_unused", "overlap_optimizer"])
def test_sync_each_batch_with_a_branch_some_micro_batches_skip_or_an_overlapped_step(unused, overlap):
    # find_unused: a rank that did not reach the branch in a micro-step sent the window's total so far again;
    # overlap_optimizer: each bucket stepped on the last micro-step's reduction, not the window's total
    one = branched(0, 0, False, False, unused)
    for w in (1, 2):
        for steps in run_ranks(branched, w, True, overlap, unused, timeout=120):
            for got, want in zip(steps, one):
                for a, b in zip(got, want):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
