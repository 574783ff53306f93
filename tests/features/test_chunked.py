"""Chunked: outputs and gradients equal the unchunked module's, alone and inside gradsync DDP."""
import collections
import dataclasses
import gc
import weakref

import pytest
import torch
from torch import nn

import gradsync
from gradsync.tools.launch import run_ranks
from helpers import assert_close_dicts, batches, grads, micro_steps, reference


def block(seed=0, width=16, dropout=0.0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, width), nn.GELU(), nn.Dropout(dropout), nn.Linear(width, 8))


def model_with_block(seed=0, chunks=None):
    torch.manual_seed(seed)
    inner = block(seed)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), gradsync.Chunked(inner, chunks) if chunks else inner,
                         nn.Linear(8, 4))


def run(module, x, weight):
    out = module(x)
    (out * weight).sum().backward()
    return out.detach()


@pytest.mark.parametrize("rows,chunks", [(10, 3), (8, 4), (3, 5), (6, 1), (0, 3)])
@pytest.mark.parametrize("input_grad", [True, False])
def test_gradients_equal_the_unchunked_module(rows, chunks, input_grad):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 8, generator=g)
    weight = torch.randn(rows, 8, generator=g)
    ref, ours = block(), gradsync.Chunked(block(), chunks)
    xa, xb = x.clone().requires_grad_(input_grad), x.clone().requires_grad_(input_grad)
    torch.testing.assert_close(run(ours, xb, weight), run(ref, xa, weight))
    assert_close_dicts(grads(ours.module), grads(ref))
    if input_grad:
        torch.testing.assert_close(xb.grad, xa.grad)


Logits = collections.namedtuple("Logits", "scores argmax")
Extra = collections.namedtuple("Extra", "bias shift")


class TwoHeads(nn.Module):
    """Dict and namedtuple outputs (one an integer tensor), a keyword argument, a namedtuple argument."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x, extra, *, scale):
        h = torch.tanh(self.a(x) + extra.bias + extra.shift)  # bias: (8,), the same for every row
        return {"h": h * scale, "logits": Logits(self.b(h), h.argmax(1)), "tag": "heads"}


def test_structured_outputs_kwargs_and_unsplit_arguments():
    g = torch.Generator().manual_seed(0)
    x, bias, scale, shift = (torch.randn(9, 8, generator=g), torch.randn(8, generator=g),
                             torch.randn(9, 1, generator=g), torch.randn(9, 8, generator=g))
    outs, got = [], []
    for chunks in (None, 4):
        torch.manual_seed(0)
        module = TwoHeads()
        wrapped = gradsync.Chunked(module, chunks) if chunks else module
        xs, bs, ss, hs = (t.clone().requires_grad_() for t in (x, bias, scale, shift))
        out = wrapped(xs, Extra(bs, hs), scale=ss)
        assert out["tag"] == "heads" and out["logits"][1].dtype == torch.int64
        assert type(out["logits"]) is Logits
        (out["h"].square().sum() + out["logits"][0].sin().sum()).backward()
        outs.append(out)
        got.append({**grads(module), "x": xs.grad, "bias": bs.grad, "scale": ss.grad, "shift": hs.grad})
    torch.testing.assert_close(outs[1]["h"], outs[0]["h"])
    assert torch.equal(outs[1]["logits"][1], outs[0]["logits"][1])
    assert_close_dicts(got[1], got[0])


class Aliasing(nn.Module):
    """Gradients autograd hands out twice: one tensor for p1 and p2, the incoming one for q."""

    def __init__(self):
        super().__init__()
        self.p1, self.p2 = nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(8, 8))
        self.q = nn.Parameter(torch.randn(2, 8))  # the size of one chunk: passed straight through

    def forward(self, x):
        return x @ (self.p1 + self.p2) + self.q


def test_parameter_gradients_that_alias_are_not_summed_in_place():
    torch.manual_seed(0)
    module, x = Aliasing(), torch.randn(8, 8)
    weight = torch.randn(8, 8)
    (torch.cat([module(part) for part in x.split(2)]) * weight).sum().backward()
    want = grads(module)
    module.zero_grad()
    run(gradsync.Chunked(module, 4), x, weight)
    assert_close_dicts(grads(module), want)


def test_dropout_replays_each_chunks_random_numbers():
    x = torch.randn(12, 8, generator=torch.Generator().manual_seed(1))
    module = block(dropout=0.5)
    torch.manual_seed(7)
    ref_out = torch.cat([module(part) for part in x.tensor_split(3)])  # the chunks, kept in memory
    ref_out.square().sum().backward()
    ref_grads, after_ref = grads(module), torch.get_rng_state()
    module.zero_grad()
    torch.manual_seed(7)
    out = gradsync.Chunked(module, 3)(x)
    after_forward = torch.get_rng_state()
    out.square().sum().backward()
    torch.testing.assert_close(out, ref_out)
    assert_close_dicts(grads(module), ref_grads)
    assert torch.equal(after_forward, after_ref)  # the forward consumed what the chunks would
    assert torch.equal(torch.get_rng_state(), after_ref)  # and the recomputation gave it back


def test_recomputation_runs_under_the_forwards_autocast():
    module = block()
    dtypes = []
    module[0].register_forward_hook(lambda m, i, out: dtypes.append(out.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = gradsync.Chunked(module, 4)(torch.randn(8, 8))
    out.float().sum().backward()  # outside the autocast region, as training loops do
    assert dtypes == [torch.bfloat16] * 8 and out.dtype == torch.bfloat16


def test_each_parameter_is_accumulated_once_per_backward():
    module = block()
    fired = {n: 0 for n, _ in module.named_parameters()}
    for n, p in module.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, n=n: fired.__setitem__(n, fired[n] + 1))
    gradsync.Chunked(module, 4)(torch.randn(8, 8)).sum().backward()
    assert set(fired.values()) == {1}


def test_no_activation_outlives_its_chunk_without_the_garbage_collector():
    module = block()
    alive = []
    for layer in (module[1], module[3]):  # an activation and the chunk's output
        layer.register_forward_hook(lambda m, i, out: alive.append(weakref.ref(out.untyped_storage())))
    gc.disable()
    try:
        out = gradsync.Chunked(module, 4)(torch.randn(8, 8, requires_grad=True))
        assert len(alive) == 8 and all(r() is None for r in alive)  # forward keeps no activations
        out.sum().backward()
        assert len(alive) == 16 and all(r() is None for r in alive)  # nor does the recomputation
    finally:
        gc.enable()


def test_no_grad_and_frozen_runs_are_plain_calls_and_batch_norm_is_refused():
    x = torch.randn(6, 8)
    module = block()
    with torch.no_grad():
        torch.testing.assert_close(gradsync.Chunked(module, 3)(x), module(x))
    norm = gradsync.Chunked(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)), 2)
    with pytest.raises(ValueError, match="BatchNorm1d '1' in training mode"):
        norm(x)
    norm.eval()
    norm(x).sum().backward()
    x.requires_grad_()
    (g,) = torch.autograd.grad(gradsync.Chunked(module, 3)(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        g.sum().backward()  # no silent wrong second derivative
    with pytest.raises(ValueError, match="chunks must be an integer >= 1"):
        gradsync.Chunked(module, 0)
    with pytest.raises(ValueError, match="0-dim tensor"):
        gradsync.Chunked(nn.Sequential(nn.Linear(8, 8), Sum()), 2)(x)


class Sum(nn.Module):
    def forward(self, x):
        return x.sum()


def train_chunked(rank, world_size, chunks, steps):
    """2 windows of ``steps`` micro-steps: no_sync inside a window, one sync at its end."""
    model = gradsync.DDP(model_with_block(seed=rank, chunks=chunks), bucket_cap_mb=0.001,
                         first_bucket_cap_mb=0.0005)
    acc = gradsync.GradientAccumulator(model, steps=steps)
    opt = acc.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    return [grads(model.module) for _ in micro_steps(model, acc, opt, rank, world_size,
                                                     batches(2 * steps, world_size, per_rank=5))
            if acc.is_boundary]


@pytest.mark.parametrize("steps", [1, 3])
def test_under_ddp_with_two_ranks_and_no_sync_gradients_match_one_unchunked_process(steps):
    world_size = 2
    ref = model_with_block(seed=0)
    want = reference(ref, batches(2 * steps, world_size, per_rank=5), steps, torch.optim.SGD(ref.parameters(), lr=0.1))
    for history in run_ranks(train_chunked, world_size, 3, steps):
        assert len(history) == 2
        for got, expected in zip(history, want):
            assert_close_dicts({k.replace(".module.", "."): v for k, v in got.items()}, expected)


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    rows: int = dataclasses.field(init=False)  # set from x: rebuilt per chunk, not copied

    def __post_init__(self):
        self.rows = self.x.shape[0]


@dataclasses.dataclass(frozen=True)
class Out:
    y: torch.Tensor
    rows: int
    extra: dict


class Containers(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, batch, table):
        y = self.l(batch.x) + table["shift"]
        return Out(y, batch.rows - batch.x.shape[0], collections.defaultdict(list, y2=y * 2))


def test_dataclass_and_defaultdict_inputs_and_outputs_are_split_and_stitched():
    g = torch.Generator().manual_seed(0)
    x, shift = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
    outs, got = [], []
    for chunks in (None, 3):
        torch.manual_seed(0)
        module = Containers()
        xs, ss = x.clone().requires_grad_(), shift.clone().requires_grad_()
        out = (gradsync.Chunked(module, chunks) if chunks else module)(
            Batch(xs), collections.defaultdict(int, shift=ss))
        assert type(out) is Out and type(out.extra) is collections.defaultdict and out.extra.default_factory is list
        assert out.rows == 0 and out.extra["missing"] == []
        (out.y.sin().sum() + out.extra["y2"].square().sum()).backward()
        outs.append(out)
        got.append({**grads(module), "x": xs.grad, "shift": ss.grad})
    torch.testing.assert_close(outs[1].y, outs[0].y)
    assert_close_dicts(got[1], got[0])


def test_hugging_face_model_outputs_are_stitched():
    modeling_outputs = pytest.importorskip("transformers.modeling_outputs")

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(8, 8)

        def forward(self, x):
            return modeling_outputs.BaseModelOutput(last_hidden_state=self.l(x), hidden_states=(x, self.l(x)))

    torch.manual_seed(0)
    module, x = Head(), torch.randn(6, 8)
    plain, chunked = module(x), gradsync.Chunked(module, 3)(x)
    assert type(chunked) is type(plain) and list(chunked.keys()) == list(plain.keys())
    torch.testing.assert_close(chunked.last_hidden_state, plain.last_hidden_state)
    torch.testing.assert_close(chunked["hidden_states"][1], plain.hidden_states[1])
    assert chunked.last_hidden_state.requires_grad and chunked.attentions is None


class Returns(nn.Module):
    def __init__(self, extra):
        super().__init__()
        self.l, self.extra = nn.Linear(8, 8), extra

    def forward(self, x):
        y = self.l(x)
        return y, self.extra(self, x, y)


@pytest.mark.parametrize("extra,shape", [(lambda m, x, y: y.square().mean().reshape(1), r"\(1,\)"),
                                         (lambda m, x, y: m.l.weight, r"\(8, 8\)")])
def test_outputs_without_the_chunks_rows_are_refused(extra, shape):
    with pytest.raises(ValueError, match=rf"batch dimension to stitch along; it returned a tensor of shape {shape} "
                                         r"for a chunk of 2 rows"):
        gradsync.Chunked(Returns(extra), 4)(torch.randn(8, 8))


def test_non_tensor_outputs_must_be_equal_in_every_chunk():
    x = torch.randn(10, 8)
    y, same = gradsync.Chunked(Returns(lambda m, x, y: {"tag": "a", "none": None, "n": 3.0}), 4)(x)
    assert same == {"tag": "a", "none": None, "n": 3.0} and y.shape == (10, 8)
    with pytest.raises(ValueError, match=r"non-tensor output that differs between chunks \(3 in chunk 0, 2 in "
                                         r"chunk 2\); Chunked cannot stitch it"):
        gradsync.Chunked(Returns(lambda m, x, y: x.shape[0]), 4)(x)


class Tracker(nn.Module):
    """Updates a buffer in forward: in place, by reassignment, or only once (a lazy initialization)."""

    def __init__(self, how):
        super().__init__()
        self.l, self.how = nn.Linear(8, 8), how
        self.register_buffer("seen", torch.zeros(()))
        self.register_buffer("table", torch.full((3,), float("nan")))  # NaN: unchanged all the same

    def forward(self, x):
        with torch.no_grad():
            if self.how == "in place":
                self.seen += x.shape[0]
            elif self.how == "assigned":
                self.seen = self.seen + x.shape[0]
            elif self.seen == 0:
                self.seen.fill_(1.0)
        return self.l(x)


@pytest.mark.parametrize("how", ["in place", "assigned"])
def test_buffers_updated_in_forward_are_refused(how):
    module, x = Tracker(how), torch.randn(8, 8)
    with pytest.raises(ValueError, match="Chunked module changed its buffer 'seen' in forward"):
        gradsync.Chunked(module, 4)(x)
    with torch.no_grad():
        gradsync.Chunked(module, 4)(x)  # nothing is recomputed: a plain call
    module.requires_grad_(False)
    gradsync.Chunked(module, 4)(x)


@pytest.mark.parametrize("chunks, rows", [(4, 8), (1, 8), (4, 1)])
def test_a_buffer_set_once_is_not_refused(chunks, rows):
    """With one chunk (chunks=1, or a batch of one row) the last chunk was the first, where the buffer is set."""
    module, x = Tracker("once"), torch.randn(rows, 8)
    chunked = gradsync.Chunked(module, chunks)
    for _ in range(3):
        chunked(x).sum().backward()
    assert float(module.seen) == 1.0 and module.l.weight.grad is not None
