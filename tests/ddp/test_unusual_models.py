"""Unusual models against torch 2.13's DDP (issue 14 item 6): tied weights, sparse gradients, complex
and 0-dim parameters, a parameter that never gets a gradient, integer and bool buffers, meta tensors.
Each row either trains exactly like torch's DDP in the same process group or is refused at construction."""
import contextlib
import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import prune
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import gradsync
from gradsync.tools.launch import run_ranks
from helpers import TIMEOUT, assert_close_dicts, faults, grads, outcome, params, shard

TorchDDP = nn.parallel.DistributedDataParallel
VOCAB = 10


class Tied(nn.Module):
    """A language-model head that shares the embedding's weight."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.tanh(self.mid(self.emb(x))))


class Odd(nn.Module):
    """An embedding, then a real or a complex layer; options: a 0-dim scale, a parameter no forward
    uses, an int64 step counter and a bool mask in the output."""

    def __init__(self, complex=False, scalar=False, unused=False, buffers=False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 8)
        dtype = torch.cfloat if complex else torch.float
        self.rotate = nn.Parameter(torch.randn(8, VOCAB, dtype=dtype))
        self.scale = nn.Parameter(torch.tensor(2.0)) if scalar else None
        self.unused = nn.Parameter(torch.randn(3)) if unused else None
        if buffers:
            self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
            self.register_buffer("mask", torch.ones(VOCAB, dtype=torch.bool))

    def forward(self, x):
        logits = (self.emb(x).to(self.rotate.dtype) @ self.rotate).abs()
        if self.scale is not None:
            logits = logits * self.scale
        if hasattr(self, "steps"):
            self.steps += 1
            logits = logits.masked_fill(~self.mask, 0) + self.steps
        return logits


def tokens(steps, world_size, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (4 * world_size,), generator=g),
             torch.randint(0, VOCAB, (4 * world_size,), generator=g)) for _ in range(steps)]


def train(model, rank, world_size, steps=2):
    """SGD steps on this rank's shards; return each step's gradients (sparse ones made dense)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    history = []
    for x, y in tokens(steps, world_size):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
        history.append({n: g.to_dense() for n, g in grads(model.module).items()})
        opt.step()
    return history, params(model.module), dict(model.module.named_buffers())


def side_by_side(rank, world_size, make, hook=None, view=False, find_unused=False):
    """Train the same model wrapped in torch's DDP and in gradsync's, one after the other."""
    model = make()
    kwargs = dict(gradient_as_bucket_view=view, find_unused_parameters=find_unused)
    theirs = TorchDDP(copy.deepcopy(model), **kwargs)
    ours = gradsync.DDP(model, timeout=TIMEOUT, **kwargs)
    if hook is not None:
        theirs.register_comm_hook(None, hook)
        ours.register_comm_hook(None, hook)
    return train(theirs, rank, world_size), train(ours, rank, world_size)


def assert_same_training(results):
    for theirs, ours in results:
        for a, b in zip(theirs[0], ours[0]):  # gradients of every step
            assert_close_dicts(a, b)
        assert_close_dicts(theirs[1], ours[1])  # parameters
        assert_close_dicts(theirs[2], ours[2], atol=0, rtol=0)  # buffers
    assert_close_dicts(results[0][1][1], results[1][1][1], atol=0, rtol=0)  # ranks agree bit for bit


def test_tied_weights_train_like_torch():
    assert_same_training(run_ranks(side_by_side, 2, Tied, timeout=60))


class Scripted(nn.Module):
    """A scripted and a traced submodule: their slot dicts are torch.jit's own wrappers, not dicts."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 8)
        self.mid = torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.Tanh()))
        self.head = torch.jit.trace(nn.Linear(8, VOCAB), torch.randn(2, 8))

    def forward(self, x):
        return self.head(self.mid(self.emb(x)))


def scripted_whole():
    return torch.jit.script(Tied())


def scripted_side_by_side(rank, world_size, make):  # a deep copy of a scripted module has non-leaf parameters
    return (train(TorchDDP(make()), rank, world_size),
            train(gradsync.DDP(make(), timeout=TIMEOUT), rank, world_size))


@pytest.mark.parametrize("make", [Scripted, scripted_whole])
def test_scripted_and_traced_modules_train_like_torch(make):
    assert_same_training(run_ranks(scripted_side_by_side, 2, make, timeout=60))


def renamed_after_wrapping(rank, world_size, how):
    """prune and the legacy spectral_norm rename a wrapped parameter (weight -> weight_orig): the same object, later
    in parameters()' order."""
    out = []
    for wrap in (TorchDDP, lambda m: gradsync.DDP(m, timeout=TIMEOUT)):
        torch.manual_seed(0)
        module = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, VOCAB))
        model = wrap(module)
        torch.manual_seed(1)
        if how == "prune":
            prune.l1_unstructured(module[1], "weight", amount=0.3)
        else:
            nn.utils.spectral_norm(module[1])
        out.append(train(model, rank, world_size, steps=3))
    return out


@pytest.mark.parametrize("how", ["prune", "spectral_norm"])
def test_a_parameter_renamed_after_wrapping_trains_like_torch(how):
    assert_same_training(run_ranks(renamed_after_wrapping, 2, how, timeout=60))


def test_a_lazy_buffer_is_refused_at_construction():
    for kind, message, _ in faults(lambda rank, world_size: outcome(
            lambda: gradsync.DDP(nn.Sequential(nn.Linear(4, 4), nn.LazyBatchNorm1d(affine=False)), timeout=TIMEOUT))):
        assert kind == "ValueError" and "buffer '1.running_mean' is lazy (uninitialized)" in message, message


@pytest.mark.parametrize("view", [False, True])
def test_complex_parameters_train_like_torch(view):
    make = functools.partial(Odd, complex=True)
    assert_same_training(run_ranks(side_by_side, 2, make, None, view, timeout=60))


def test_complex_parameters_with_a_casting_comm_hook_train_like_torch():
    make = functools.partial(Odd, complex=True)
    assert_same_training(run_ranks(side_by_side, 2, make, default_hooks.fp16_compress_hook, timeout=60))


@pytest.mark.parametrize("view", [False, True])
def test_0_dim_parameter_trains_like_torch(view):
    make = functools.partial(Odd, scalar=True)
    results = run_ranks(side_by_side, 2, make, None, view, timeout=60)
    assert_same_training(results)
    assert results[0][1][0][0]["scale"].shape == ()


def rank_buffers(rank, world_size):
    """Odd with buffers that differ across ranks before wrapping and change differently in forward."""
    def make():
        model = Odd(buffers=True)
        model.steps.fill_(5 * rank)  # the initial broadcast overwrites these with rank 0's
        model.mask[rank] = False
        model.register_forward_hook(lambda m, args, out: m.mask.__setitem__(rank + 2, False))
        return model
    return side_by_side(rank, world_size, make)


def test_integer_and_bool_buffers_train_like_torch():
    results = run_ranks(rank_buffers, 2, timeout=60)
    assert_same_training(results)
    theirs = results[0][0][2]  # rank 0 after two steps: buffers broadcast at construction and each forward
    assert theirs["steps"] == 2 and theirs["mask"].tolist() == [False, True, False] + [True] * 7


def never_grad(rank, world_size):
    theirs = TorchDDP(Odd(unused=True))
    ours = gradsync.DDP(Odd(unused=True), timeout=TIMEOUT)
    return [outcome(lambda m=m: train(m, rank, world_size)) for m in (theirs, ours)]


def test_parameter_that_never_gets_a_gradient():
    for theirs, ours in faults(never_grad):
        # torch notices at the next forward, gradsync at the end of the first backward, naming it
        assert theirs[0] == "RuntimeError" and "Expected to have finished reduction" in theirs[1], theirs
        assert ours[0] == "RuntimeError" and "1 parameter(s)" in ours[1] and ": unused." in ours[1], ours
        assert "find_unused_parameters=True" in ours[1]
    results = run_ranks(side_by_side, 2, functools.partial(Odd, unused=True), None, False, True, timeout=60)
    assert_same_training(results)
    assert all("unused" not in step for _, ours in results for step in ours[0])  # .grad stays None


class PartlyMeta(nn.Module):
    def __init__(self, where):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(VOCAB, VOCAB)
        with torch.device("meta"):
            if where == "buffer":
                self.register_buffer("table", torch.zeros(4))
            else:
                self.later = nn.Linear(8, VOCAB)

    def forward(self, x):
        return self.lin(F.one_hot(x, VOCAB).float())


def meta(rank, world_size, where):
    make = (lambda: nn.Linear(VOCAB, VOCAB, device="meta")) if where == "all" else (lambda: PartlyMeta(where))
    return [outcome(lambda cls=cls: train(cls(make()), rank, world_size)) for cls in (TorchDDP, gradsync.DDP)]


@pytest.mark.parametrize("where, name, torch_says", [
    ("all", "'weight'", "cannot be called on meta tensors"),
    ("parameter", "'later.weight'", "must be on the same type of devices"),
])
def test_meta_parameters_are_refused_at_construction(where, name, torch_says):
    for theirs, ours in faults(meta, where):
        assert theirs[0] != "ok" and torch_says in theirs[1], theirs
        assert ours[0] == "ValueError" and f"parameter {name} is on the meta device" in ours[1], ours
        assert "to_empty(device=...)" in ours[1]


def meta_buffer(rank, world_size):
    theirs = TorchDDP(PartlyMeta("buffer"))
    ours = gradsync.DDP(PartlyMeta("buffer"), timeout=TIMEOUT)
    return train(theirs, rank, world_size)[0], train(ours, rank, world_size)[0], ours.module.table.is_meta


def test_meta_buffer_trains_like_torch():
    for theirs, ours, still_meta in run_ranks(meta_buffer, 2, timeout=60):
        for a, b in zip(theirs, ours):
            assert_close_dicts(a, b)
        assert still_meta


def embedding(sparse):
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, 8, sparse=sparse), nn.Linear(8, VOCAB))


def sparse(rank, world_size):
    theirs = TorchDDP(embedding(sparse=True))
    refused = [outcome(lambda m=m: gradsync.DDP(m, timeout=TIMEOUT))
               for m in (embedding(sparse=True), nn.EmbeddingBag(VOCAB, 8, sparse=True))]
    dense = gradsync.DDP(embedding(sparse=False), timeout=TIMEOUT)
    return refused, train(theirs, rank, world_size)[0], train(dense, rank, world_size)[0]


def test_sparse_embedding_is_refused_at_construction():
    for refused, theirs, dense in faults(sparse):
        for (kind, message, _), name in zip(refused, ["nn.Embedding '0'", "the wrapped nn.EmbeddingBag"]):
            assert kind == "NotImplementedError" and f"{name} has sparse=True" in message, message
            assert "construct it with sparse=False" in message
        for a, b in zip(theirs, dense):  # torch reduces the sparse gradient; the advice gives the same
            assert_close_dicts(a, b)


def sparse_tensors(rank, world_size):
    """A sparse parameter (torch refuses it: "No support for sparse tensors") and a sparse buffer (a graph's adjacency
    matrix: broadcast unless broadcast_buffers=False)."""
    adjacency = torch.sparse_coo_tensor([[0, 1], [1, 0]], [1.0, 1.0], (2, 2))
    with_param, with_buffer = nn.Linear(2, 2), nn.Linear(2, 2)
    with_param.sparse = nn.Parameter(adjacency.clone(), requires_grad=False)
    with_buffer.register_buffer("adjacency", adjacency)
    return [outcome(lambda: gradsync.DDP(with_param, timeout=TIMEOUT)),
            outcome(lambda: gradsync.DDP(with_buffer, timeout=TIMEOUT)),
            outcome(lambda: gradsync.DDP(with_buffer, timeout=TIMEOUT, broadcast_buffers=False))]


def test_sparse_parameters_and_broadcast_sparse_buffers_are_refused_clearly():
    for param, buffer, local_buffer in faults(sparse_tensors):
        assert param[0] == "NotImplementedError" and "parameter 'sparse' is a torch.sparse_coo tensor" in param[1], param
        assert buffer[0] == "NotImplementedError" and "buffer 'adjacency' is a torch.sparse_coo tensor" in buffer[1]
        assert "broadcast_buffers=False" in buffer[1], buffer
        assert local_buffer[0] == "ok", local_buffer  # a rank's own buffer: never broadcast


class FunctionalSparse(nn.Module):
    def __init__(self, width=VOCAB):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(VOCAB, width))

    def forward(self, x):
        return F.embedding(x, self.weight, sparse=True)[:, :VOCAB]


def functional_sparse(rank, world_size, view, window, deterministic=False):
    # a window's no_sync micro-step first, with a weight too large to be lent its view (engine/quiet.py)
    model = gradsync.DDP(FunctionalSparse(1024 if window else VOCAB), timeout=TIMEOUT, gradient_as_bucket_view=view,
                         deterministic=deterministic)

    def run():
        if window:
            with model.no_sync():
                model(torch.tensor([1, 2])).sum().backward()
        train(model, rank, world_size)
    return outcome(run)


@pytest.mark.parametrize("view,window,deterministic", [(False, False, False), (True, False, False), (True, True, False),
                                                       (False, False, True), (True, False, True)])
def test_sparse_gradient_without_an_embedding_module_is_refused_at_the_backward(view, window, deterministic):
    for kind, message, _ in faults(functional_sparse, view, window, deterministic):
        assert kind == "RuntimeError" and "'weight' has a torch.sparse_coo gradient" in message, message


def lent_view_takes_a_sparse_gradient(rank, world_size):
    """Views and a window that starts under no_sync: a small parameter whose gradient comes after the window's first
    hook holds its dense view, autograd adds the sparse gradient into it: it trains as its dense twin (reliability.md)."""
    out = []
    for sparse in (True, False):
        torch.manual_seed(0)
        model = FunctionalSparse()
        model.head = nn.Linear(VOCAB, VOCAB)  # its gradient is ready first: the window's first hook lends the views
        model.forward = functools.partial(lambda m, x: m.head(F.embedding(x, m.weight, sparse=sparse)), model)
        wrapped = gradsync.DDP(model, timeout=TIMEOUT, gradient_as_bucket_view=True)
        for x, y in tokens(2, world_size):
            with wrapped.no_sync():
                F.cross_entropy(wrapped(shard(y, rank, world_size)), shard(x, rank, world_size)).backward()
            F.cross_entropy(wrapped(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
            out.append(model.weight.grad.clone())
            model.weight.grad = None
    return out


def test_a_lent_view_takes_a_sparse_gradient_like_a_dense_one():
    for result in run_ranks(lent_view_takes_a_sparse_gradient, 2, timeout=60):
        for sparse, dense in zip(result[:2], result[2:]):
            assert sparse.layout == torch.strided
            torch.testing.assert_close(sparse, dense)  # the sparse sum adds repeated rows in another order


class Strided(nn.Module):
    """A channels_last convolution and a transposed parameter: gradients that are not row-major."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3)
        self.t = nn.Parameter(torch.randn(VOCAB, 4 * 4 * 4).t())  # (64, 10), strides (1, 64)
        self.to(memory_format=torch.channels_last)

    def forward(self, x):
        return self.conv(x).flatten(1) @ self.t


def strided(rank, world_size, view):
    """Two windows of a no_sync micro-step and a synced one; each backward's gradients and their strides."""
    model = Strided()
    out = []
    for wrapped in (TorchDDP(copy.deepcopy(model), gradient_as_bucket_view=view),
                    gradsync.DDP(model, timeout=TIMEOUT, gradient_as_bucket_view=view)):
        opt, history = torch.optim.SGD(wrapped.parameters(), lr=0.1), []
        g = torch.Generator().manual_seed(rank)
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            for sync in (False, True):
                x = torch.randn(2, 3, 6, 6, generator=g).to(memory_format=torch.channels_last)
                with contextlib.nullcontext() if sync else wrapped.no_sync():
                    F.cross_entropy(wrapped(x), torch.tensor([1, 2])).backward()
                history.append({n: (p.grad.clone(), p.grad.stride()) for n, p in wrapped.module.named_parameters()})
            opt.step()
        out.append((history, params(wrapped.module), {n: p.stride() for n, p in wrapped.module.named_parameters()}))
    return out


@pytest.mark.parametrize("view", [False, True])
def test_channels_last_and_transposed_parameters_keep_their_gradient_strides(view):
    # torch's DDP gives a bucket view the parameter's strides when the parameter is dense; autograd then
    # accumulates into .grad in its own layout, and an optimizer reads gradient and parameter alike
    for theirs, ours in run_ranks(strided, 2, view, timeout=60):
        for a, b in zip(theirs[0], ours[0]):
            assert {n: s for n, (_, s) in a.items()} == {n: s for n, (_, s) in b.items()}
            assert_close_dicts({n: g for n, (g, _) in a.items()}, {n: g for n, (g, _) in b.items()})
        assert_close_dicts(theirs[1], ours[1])
        assert theirs[2] == ours[2] and ours[2]["t"] == (1, 64) and ours[2]["conv.weight"] == (27, 1, 9, 3)
        assert all(s == ours[2][n] for n, (_, s) in ours[0][-1].items())


def two_views(rank, world_size, no_sync):
    """Two training forwards through BatchNorm, one backward on their sum (two augmented views of a batch)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    out = []
    for wrapped in (TorchDDP(copy.deepcopy(model)), gradsync.DDP(model, timeout=TIMEOUT)):
        g = torch.Generator().manual_seed(rank)
        for _ in range(2):
            with wrapped.no_sync() if no_sync else contextlib.nullcontext():
                (wrapped(torch.randn(3, 4, generator=g)).sum() + wrapped(torch.randn(3, 4, generator=g)).sum()).backward()
        out.append((grads(wrapped.module), dict(wrapped.module.named_buffers())))
    return out


@pytest.mark.parametrize("no_sync", [False, True])
def test_two_forwards_through_batchnorm_then_one_backward_like_torch(no_sync):
    # the buffers' broadcast before each forward must not count as an in-place change of what the first
    # forward saved for the backward (BatchNorm saves its running statistics): torch's leaves them unversioned
    for theirs, ours in run_ranks(two_views, 2, no_sync, timeout=60):
        assert_close_dicts(theirs[0], ours[0])
        if not no_sync:  # inside no_sync gradsync still broadcasts buffers, torch does not (docs/differences.md)
            assert_close_dicts(theirs[1], ours[1], atol=0, rtol=0)


class Sliced(nn.Module):
    """A parameter and a buffer that are every other column of a larger tensor (one stride apart, not dense), the
    buffer updated in forward with each rank's own data."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 8)
        self.out = nn.Parameter(torch.randn(8, 2 * VOCAB)[:, ::2])
        self.register_buffer("seen", torch.zeros(2, 2 * VOCAB)[:, ::2])

    def forward(self, x):
        logits = self.emb(x) @ self.out
        with torch.no_grad():
            self.seen += logits.detach().mean(0)
        return logits


@pytest.mark.parametrize("view", [False, True])
def test_strided_slices_as_parameter_and_buffer_train_like_torch(view):
    """Their broadcasts viewed the memory as bytes through a stride: a dtype-view error at construction."""
    results = run_ranks(side_by_side, 2, Sliced, None, view, timeout=60)
    assert_same_training(results)


def hooked_after_wrapping(rank, world_size, view):
    """A post-accumulate-grad hook registered after wrapping (per-rank gradient noise): torch's reducer runs after
    AccumulateGrad's hooks whatever their order; gradsync's hook, registered first, ran before it."""
    out = []
    for wrap in (TorchDDP, gradsync.DDP):
        torch.manual_seed(0)
        model = wrap(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)), gradient_as_bucket_view=view)
        for p in model.module.parameters():
            p.register_post_accumulate_grad_hook(lambda p: [p.grad.mul_(2.0).add_(float(rank)), None][1])
        out.append(gradient_history(model, rank, 3))
    return out


def gradient_history(model, rank, steps):
    """Each step's gradients of ``steps`` backwards on this rank's data, zeroed after each."""
    history = []
    for s in range(steps):
        torch.manual_seed(10 * s + rank)
        model(torch.randn(3, 4)).pow(2).sum().backward()
        history.append(grads(model.module))
        model.module.zero_grad()
    return history


@pytest.mark.parametrize("view", [False, True])
def test_a_post_accumulate_grad_hook_registered_after_wrapping_changes_the_reduced_gradient_as_in_torch(view):
    results = run_ranks(hooked_after_wrapping, 2, view, timeout=60)
    for theirs, ours in results:
        for a, b in zip(theirs, ours):
            assert_close_dicts(a, b)
    for a, b in zip(results[0][1], results[1][1]):
        assert_close_dicts(a, b, atol=0, rtol=0)


class HooksInForward(nn.Module):
    """Registers a post-accumulate-grad hook on each parameter in its first forward (lazily, after wrapping)."""

    def __init__(self, rank):
        super().__init__()
        self.body, self.rank, self.hooked = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)), rank, False

    def forward(self, x):
        if not self.hooked:
            self.hooked = True
            for p in self.parameters():
                p.register_post_accumulate_grad_hook(lambda p: [p.grad.mul_(2.0).add_(float(self.rank)), None][1])
        return self.body(x)


def hooked_in_forward(rank, world_size, kw):
    out = []
    for wrap in (TorchDDP, gradsync.DDP):
        torch.manual_seed(0)
        model = wrap(HooksInForward(rank), **(kw if wrap is gradsync.DDP else {}))
        out.append(gradient_history(model, rank, 2))
    return out


@pytest.mark.parametrize("kw", [{}, {"gradient_as_bucket_view": True}, {"deterministic": True}],  # torch: default
                         ids=["default", "views", "deterministic"])
def test_a_post_accumulate_grad_hook_registered_in_the_first_forward_changes_its_gradient_as_in_torch(kw):
    """Its hook moved after the user's only at the next forward, so the first backward reduced some (deterministic:
    all) gradients before the hook doubled them."""
    for theirs, ours in run_ranks(hooked_in_forward, 2, kw, timeout=60):
        for a, b in zip(theirs, ours):
            assert_close_dicts(a, b)


class OneUnused(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 2)
        self.unused = nn.Linear(4, 2)

    def forward(self, x):
        return self.a(x)


def set_by_hand(rank, world_size):
    out = []
    for wrap in (TorchDDP, gradsync.DDP):
        model = wrap(OneUnused(), find_unused_parameters=True)
        seen = []
        for step in range(3):
            if rank == 0:
                model.module.unused.bias.grad = torch.ones(2)  # a gradient computed elsewhere
            model(torch.randn(3, 4)).sum().backward()
            g = model.module.unused.bias.grad
            seen.append(None if g is None else g.tolist())
            model.module.zero_grad()
        out.append(seen)
    return out


def test_a_gradient_set_by_hand_on_an_unused_parameter_stays_local_from_the_first_backward():
    """The first synced backward took it for a gradient restored from a checkpoint and averaged it (0.5 on both
    ranks, rank 1's None too); torch keeps each rank's own, as gradsync did from the second backward on."""
    for theirs, ours in run_ranks(set_by_hand, 2, timeout=60):
        assert ours == theirs, (ours, theirs)


def converted_with_grads_set(rank, world_size, how):
    """Gradient views, .grad set by a backward, then a conversion that keeps dtype and device: nn.Module._apply
    writes ``param.grad.data``, which moved gradsync's view object (it is .grad) off its bucket."""
    torch.manual_seed(0)
    model = gradsync.DDP(nn.Conv2d(2, 2, 1), gradient_as_bucket_view=True)
    x = torch.full((1, 2, 2, 2), float(rank + 1))
    model(x).sum().backward()
    if how == "channels_last":
        model.to(memory_format=torch.channels_last)
    else:
        model.half()
        model.float()
    model.zero_grad(set_to_none=False)
    model(x).sum().backward()
    return model.module.weight.grad.clone()


@pytest.mark.parametrize("how", ["channels_last", "dtype_round_trip"])
def test_a_conversion_that_moves_grad_keeps_the_gradients_averaged(how):
    """Each rank kept its own gradient from then on (4.0 and 8.0 where the average is 6.0), silently."""
    results = run_ranks(converted_with_grads_set, 2, how, timeout=60)
    torch.testing.assert_close(results[0], results[1], atol=0, rtol=0)
    assert results[0].flatten()[0].item() == 6.0, results


def swapped_on_conversion(rank, world_size):
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model = gradsync.DDP(nn.Conv2d(2, 2, 1))
        model(torch.ones(1, 2, 2, 2)).sum().backward()
        model.to(memory_format=torch.channels_last)  # torch.utils.swap_tensors: the hooks stay on the old tensors
        return outcome(lambda: model(torch.ones(1, 2, 2, 2)).sum().backward())
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)


def test_parameters_swapped_by_a_conversion_after_wrapping_are_refused_at_the_forward():
    """No hook fired from then on: every backward stayed local and the replicas parted, silently (torch's DDP refuses
    the conversion itself)."""
    for kind, message, _ in run_ranks(swapped_on_conversion, 2, timeout=60):
        assert kind == "RuntimeError" and "swap" in message and "'weight'" in message, (kind, message)
