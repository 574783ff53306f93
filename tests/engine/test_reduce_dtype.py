"""reduce_dtype: fp32 accumulation and reduction of bf16 gradients, against an exact fp64 sum.

The reference sums, in fp64, the same per-micro-step bf16 gradients every rank computes (each rank
recomputes all ranks' micro-steps on a local copy), so only accumulation and reduction differ.
Tolerance: relative L2 error below 1e-6 (fp32 sums of a few dozen bf16 values are nearly exact),
where the bf16 default path is off by more than 1e-4.
"""
import contextlib
import copy
import warnings

import pytest
import torch

import gradsync
from gradsync.tools.launch import run_ranks
from bf16 import exact_window, loss_on, rel_err
from helpers import batches, faults, mlp, outcome

CAPS = dict(bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005)  # several buckets on the small MLP
TOL = 1e-6


def window_errors(rank, world_size, steps, reduce_dtype=torch.float32, sync_each_batch=False,
                  gradient_as_bucket_view=False, hook=None, windows=2):
    model = gradsync.DDP(mlp(seed=0, dtype=torch.bfloat16), reduce_dtype=reduce_dtype,
                         gradient_as_bucket_view=gradient_as_bucket_view, **CAPS)
    seen = []
    if hook is not None:
        def recording(state, bucket):
            seen.append(bucket.buffer().dtype)
            return hook(state, bucket)
        model.register_comm_hook(None, recording)
    acc = gradsync.GradientAccumulator(model, steps, sync_each_batch=sync_each_batch)
    opt = acc.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.0))
    data = batches(steps * windows, world_size, seed=3)
    errors = []
    for w in range(windows):
        window = data[w * steps:(w + 1) * steps]
        for x, y in window:
            with acc.accumulate():
                acc.backward(loss_on(model, x, y, rank, world_size))
                if acc.is_boundary:
                    exact = exact_window(window, world_size)
                    for n, p in model.module.named_parameters():
                        src = p.main_grad if reduce_dtype is not None else p.grad
                        errors.append(rel_err(src, exact[n]))
                        if reduce_dtype is not None:
                            assert p.main_grad.dtype == reduce_dtype and p.grad.dtype == torch.bfloat16
                            assert torch.equal(p.grad, p.main_grad.to(torch.bfloat16))
                opt.step()
                opt.zero_grad()
    return max(errors), set(seen), len(model.reducer.buckets)


@pytest.mark.parametrize("sync_each_batch", [False, True])
def test_accumulation_and_reduction_in_fp32(sync_each_batch):
    results = run_ranks(window_errors, 2, 8, torch.float32, sync_each_batch)
    assert all(err < TOL for err, _, _ in results), results
    bf16 = run_ranks(window_errors, 2, 8, None, sync_each_batch)
    assert all(err > 100 * TOL for err, _, _ in bf16), bf16  # the default path rounds in bf16


def test_views_and_hooks_see_fp32():
    results = run_ranks(window_errors, 2, 4, torch.float32, False, True, gradsync.allreduce_hook)
    for err, seen, buckets in results:
        assert err < TOL and seen == {torch.float32} and buckets > 1


def hooked(rank, world_size, hook, steps=8):
    """One window of ``steps`` micro-steps with ``hook``: (relative error, flat main_grad)."""
    model = gradsync.DDP(mlp(seed=0, dtype=torch.bfloat16), reduce_dtype=torch.float32, **CAPS)
    model.register_comm_hook(None, hook)
    data = batches(steps, world_size, seed=3)
    for j, (x, y) in enumerate(data):
        model.require_backward_grad_sync = j == steps - 1
        (loss_on(model, x, y, rank, world_size) / steps).backward()
    exact = exact_window(data, world_size)
    got = torch.cat([p.main_grad.reshape(-1) for p in model.module.parameters()])
    return rel_err(got, torch.cat([exact[n].reshape(-1) for n, _ in model.module.named_parameters()])), got


@pytest.mark.parametrize("world_size", [2, 3])
def test_bf16_wire_hook_sums_in_fp32(world_size):
    """Two bf16 roundings (2**-9 relative each) whatever the world size; the fp32 window stays exact."""
    wire = run_ranks(hooked, world_size, gradsync.bf16_wire_hook)
    assert all(torch.equal(got, wire[0][1]) for _, got in wire)  # the same average on every rank
    assert 0 < wire[0][0] < 2 ** -8


def main_grad_layout(rank, world_size):
    model = gradsync.DDP(mlp(seed=0, dtype=torch.bfloat16), reduce_dtype=torch.float32, **CAPS)
    x, y = batches(1, world_size)[0]
    loss_on(model, x, y, rank, world_size).backward()
    buffers = {b.buffer.untyped_storage().data_ptr() for b in model.reducer.buckets}
    for p in model.module.parameters():
        assert p.main_grad.untyped_storage().data_ptr() in buffers  # a view, no extra copy
    model.scale_grads_(0.5)
    return {n: (p.grad.clone(), p.main_grad.clone()) for n, p in model.module.named_parameters()}


def test_main_grad_is_a_bucket_view_and_scales_with_grad():
    a, b = run_ranks(main_grad_layout, 2)
    for n, (grad, main) in a.items():
        assert torch.equal(main, b[n][1])  # identical on every rank
        torch.testing.assert_close(grad, main.to(torch.bfloat16), atol=0, rtol=1e-2)


def main_grad_after_the_wrapper(rank, world_size):
    """A deleted wrapper takes its buckets along: no ``main_grad`` is left pointing into them; a wrapper made again
    keeps its own ``main_grad`` when the one it replaced is collected after it."""
    import gc
    import weakref
    module = mlp(seed=0, dtype=torch.bfloat16)
    x, y = batches(1, world_size)[0]
    model = gradsync.DDP(module, reduce_dtype=torch.float32)
    loss_on(model, x, y, rank, world_size).backward()
    gone = weakref.ref(model.reducer.buckets[0].buffer)
    del model
    gc.collect()
    left = [n for n, p in module.named_parameters() if hasattr(p, "main_grad")]
    first = gradsync.DDP(module, reduce_dtype=torch.float32)
    second = gradsync.DDP(module, reduce_dtype=torch.float32)  # takes the parameters over
    del first
    gc.collect()
    kept = all(p.main_grad.untyped_storage().data_ptr() in {b.buffer.untyped_storage().data_ptr()
                                                            for b in second.reducer.buckets} for p in module.parameters())
    return left, gone() is None, kept


def test_a_deleted_wrapper_leaves_no_main_grad_behind():
    for left, freed, kept in run_ranks(main_grad_after_the_wrapper, 2):
        assert left == [] and freed and kept


def resumed(rank, world_size, split):
    """Accumulate 6 micro-steps; with ``split``, checkpoint after ``split`` and resume in a new model."""
    data = batches(6, world_size, seed=5)
    model = gradsync.DDP(mlp(seed=0, dtype=torch.bfloat16), reduce_dtype=torch.float32, **CAPS)
    state = None
    for j, (x, y) in enumerate(data):
        if j == split:
            state = model.grad_state_dict()
            model = gradsync.DDP(mlp(seed=0, dtype=torch.bfloat16), reduce_dtype=torch.float32, **CAPS)
            model.load_grad_state_dict(state)
        model.require_backward_grad_sync = j == len(data) - 1
        loss_on(model, x, y, rank, world_size).backward()
    kinds = {t.dtype for t in state["main_grads"].values()} if state else set()
    return {n: p.main_grad.clone() for n, p in model.module.named_parameters()}, kinds


def test_checkpoint_mid_window_keeps_fp32():
    straight = run_ranks(resumed, 2, None)
    split = run_ranks(resumed, 2, 3)
    for (a, _), (b, kinds) in zip(straight, split):
        assert kinds == {torch.float32}
        for n in a:
            assert torch.equal(a[n], b[n]), n


def carried(rank, world_size, reduce_dtype):
    """Two synced backwards without zero_grad: .grad adds up, as in torch."""
    model = gradsync.DDP(mlp(seed=0, dtype=torch.bfloat16), reduce_dtype=reduce_dtype)
    for x, y in batches(2, world_size, seed=7):
        loss_on(model, x, y, rank, world_size).backward()
    return {n: p.grad.float() for n, p in model.module.named_parameters()}


def test_gradients_not_zeroed_carry_over():
    fp32, bf16 = run_ranks(carried, 2, torch.float32)[0], run_ranks(carried, 2, None)[0]
    for n in fp32:
        torch.testing.assert_close(fp32[n], bf16[n], atol=1e-3, rtol=2e-2)


def construct(rank, world_size, dtype, reduce_dtype):
    gradsync.DDP(mlp(seed=0, dtype=dtype), reduce_dtype=reduce_dtype)


@pytest.mark.parametrize("dtype,reduce_dtype,error,match", [
    (torch.bfloat16, torch.int32, TypeError, "floating-point"),
    (torch.bfloat16, "float32", TypeError, "floating-point"),
    (torch.float32, torch.bfloat16, ValueError, "torch.float32 parameters"),
    (torch.float16, torch.bfloat16, ValueError, "torch.float16"),
    (torch.complex64, torch.float32, ValueError, "real floating-point parameters, and the model has torch.complex64"),
])
def test_reduce_dtype_is_validated(dtype, reduce_dtype, error, match):
    with pytest.raises(Exception, match=f"{error.__name__}: gradsync: .*{match}"):
        run_ranks(construct, 1, dtype, reduce_dtype)


def create_graph(rank, world_size, synced):
    model = gradsync.DDP(mlp(seed=0), reduce_dtype=torch.float64)
    with model.no_sync() if not synced else contextlib.nullcontext():
        model(torch.randn(2, 8)).square().sum().backward(create_graph=True)


@pytest.mark.parametrize("synced", [False, True])
def test_create_graph_is_refused_where_grad_cannot_carry_its_graph(synced):
    # the average would be right, but .grad would carry no graph: a penalty on it would differentiate to nothing
    for result in faults(create_graph, synced):
        assert "backward(create_graph=True) with reduce_dtype=torch.float64" in str(result), result


def dropped_micro_step(rank, world_size):
    """A window's no_sync micro-step dropped by the model's zero_grad(), then a synced backward."""
    out = []
    for wrap, kwargs in ((torch.nn.parallel.DistributedDataParallel, {}), (gradsync.DDP, {"reduce_dtype": torch.float64})):
        model = wrap(mlp(seed=0), **kwargs)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
        with model.no_sync():
            model(x).square().sum().backward()
        model.zero_grad()
        model(x[:2]).sum().backward()
        out.append({n: p.grad.clone() for n, p in model.module.named_parameters()})
    return out


def test_the_models_zero_grad_drops_the_windows_slots():
    # the slots, not .grad (None inside a window), hold the micro-steps: nn.Module.zero_grad alone left them there
    for theirs, ours in run_ranks(dropped_micro_step, 2):
        for name in theirs:
            torch.testing.assert_close(ours[name], theirs[name], msg=name)


def fp32_twins(rank, world_size):
    import copy
    import torch.nn.functional as F
    from helpers import shard
    plain = gradsync.DDP(mlp(seed=0), **CAPS)
    slots = gradsync.DDP(copy.deepcopy(plain.module), reduce_dtype=torch.float32, **CAPS)
    differ = []
    for k, (x, y) in enumerate(batches(6, world_size)):
        xs, ys = shard(x, rank, world_size), shard(y, rank, world_size)
        for model in (plain, slots):
            ctx = model.no_sync() if k % 2 == 0 else contextlib.nullcontext()
            with ctx:
                F.mse_loss(model(xs), ys).backward()
        if k % 2:
            differ.append(sum(int((a.grad != b.grad).sum()) for a, b in zip(plain.parameters(), slots.parameters())))
            for model in (plain, slots):
                model.zero_grad()
    return differ


def test_float32_slots_of_a_float32_model_average_to_the_plain_bits_at_three_ranks():
    """Both scale a window's gradient by 1 / W (a division differs in the last bit at W=3)."""
    assert run_ranks(fp32_twins, 3) == [[0, 0, 0]] * 3


def user_hooks(rank, world_size, kind):
    """A float32 model with float32 slots: the slot takes each gradient in a tensor hook registered at wrapping."""
    torch.manual_seed(0)
    model = gradsync.DDP(torch.nn.Linear(4, 2), reduce_dtype=torch.float32)
    for p in model.module.parameters():
        if kind == "tensor":  # registered after wrapping: the gradient the reducer sees is the hook's, as in torch
            p.register_hook(lambda g: g * 2)
        else:
            p.register_post_accumulate_grad_hook(lambda p: None)
    torch.manual_seed(rank)
    x = torch.randn(3, 4)
    model(x).pow(2).sum().backward()
    ref = torch.nn.Linear(4, 2)
    ref.load_state_dict(model.module.state_dict())
    ref(x).pow(2).sum().backward()
    g = ref.weight.grad.clone()
    torch.distributed.all_reduce(g)
    return (model.module.weight.grad - 2 * g / world_size).abs().max().item()


def test_a_tensor_hook_registered_after_wrapping_changes_the_reduced_gradient():
    """The slot's hook ran first and took the gradient before the user's hook doubled it."""
    assert run_ranks(user_hooks, 2, "tensor") == [0.0, 0.0]


def warned_of_a_post_hook(rank, world_size):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        user_hooks(rank, world_size, "post")
        user_hooks(rank, world_size, "post")
    return [str(w.message) for w in caught if "register_post_accumulate_grad_hook" in str(w.message)]


def test_a_post_accumulate_grad_hook_is_warned_of_by_each_model():
    """Its change to .grad reaches no slot (the slot took the gradient before AccumulateGrad): said, not refused, since
    a hook that only reads (logging) is fine."""
    for messages in run_ranks(warned_of_a_post_hook, 2):
        assert len(messages) == 2 and "'weight'" in messages[0] and "param.register_hook" in messages[0], messages


class NoBiasGrad(torch.autograd.Function):
    """A linear layer whose backward gives the bias no gradient (undefined): autograd still runs the bias's hooks."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, go):
        x, w = ctx.saved_tensors
        return go @ w, go.t() @ x, None


class NoBiasGradNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.c = torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)

    def forward(self, x):
        return NoBiasGrad.apply(torch.relu(self.a(x)), self.c.weight, self.c.bias)


def undefined_gradient(rank, world_size):
    """float32 slots of a float32 model against torch's DDP in the same group: the same bits."""
    torch.manual_seed(0)
    net = NoBiasGradNet()
    ours = gradsync.DDP(copy.deepcopy(net), reduce_dtype=torch.float32)
    theirs = torch.nn.parallel.DistributedDataParallel(net)
    torch.manual_seed(rank)
    x = torch.randn(4, 4)
    for model in (ours, theirs):
        model(x).pow(2).sum().backward()
    return [(n, p.grad is None, q.grad is None or p.grad is None or torch.equal(p.grad, q.grad))
            for (n, p), q in zip(ours.module.named_parameters(), theirs.module.parameters())]


def test_an_undefined_gradient_is_no_gradient_as_in_torch():
    """A custom Function's backward returned None for a parameter: its tensor hook got None (was an AttributeError)."""
    for rows in run_ranks(undefined_gradient, 2):
        assert all(same for _, _, same in rows), rows
