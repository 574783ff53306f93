"""torch.compile (issue 15): every compile form gives eager gradsync's and torch's DDP's gradients,
no recompiles across micro-steps, and bucket collectives that start inside the compiled backward."""
import contextlib
import inspect
import sys
import time

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gradsync
from gradsync.tools.launch import compile_before_forking, run_ranks
from helpers import TIMEOUT, Branches, assert_close_dicts, batches, faults, outcome, params, shard

TorchDDP = nn.parallel.DistributedDataParallel
# aot_eager runs Dynamo's graphs and AOT autograd's joint forward/backward as inductor gets them,
# without compiling C++ (tens of seconds per graph on this CPU); inductor runs in one case.
BACKEND = "aot_eager"
SMALL = dict(bucket_cap_mb=0.001)  # several buckets, and a graph split per bucket under compile
# each rank compiles before its first collective: on a loaded machine one may finish long after the other, and the
# process group's default 20 s would end the wait (as it did in test_skips.py's compiled drill); a hang still fails
COMPILING = 120.0


@pytest.fixture(autouse=True, scope="module")
def warm_compile_stack():
    """Forked ranks inherit what this process has loaded: each backend's first compile is paid here once. The ranks
    compile in their own process too (compile_threads=1): a worker pool per rank starts new interpreters."""
    import torch._inductor.config
    with torch._inductor.config.patch(compile_threads=1):
        compile_before_forking(BACKEND, "inductor")
        yield


class Net(nn.Module):
    """User code, so Dynamo compiles it (torch's own Sequential is skipped, like any torch file)."""

    def __init__(self, width: int = 32, depth: int = 4, features: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(features if i == 0 else width, width) for i in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def build(form, wrap, module, backend=BACKEND, **opts):
    """Return (wrapper, what to call): form "eager", "outer" (compile the wrapper) or "inner"."""
    torch._dynamo.reset()
    if form == "inner":
        module = torch.compile(module, backend=backend)
    model = wrap(module, **opts)
    return model, (torch.compile(model, backend=backend) if form == "outer" else model)


def unwrapped(model):
    return {n.replace("_orig_mod.", ""): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def windows(model, run, rank, world_size, n_windows=2, steps=2, use_b=None):
    """no_sync micro-steps, then a synced one; each window's gradients."""
    history = []
    data = batches(n_windows * steps, world_size)
    for k, (x, y) in enumerate(data):
        kwargs = {} if use_b is None else {"use_b": use_b(k, rank)}
        with model.no_sync() if (k + 1) % steps else contextlib.nullcontext():
            loss = F.mse_loss(run(shard(x, rank, world_size), **kwargs), shard(y, rank, world_size))
            (loss / steps).backward()
        if (k + 1) % steps == 0:
            history.append(unwrapped(model))
            model.zero_grad(set_to_none=True)
    return history


CASES = {  # name: (model, wrapper options, use_b pattern, micro-steps per window)
    "plain": (Net, SMALL, None, 2),
    "unused": (Branches, dict(find_unused_parameters=True, **SMALL), lambda k, rank: k % 2 == rank, 2),
    # torch's C++ reducer asserts on a no_sync backward before the first static_graph iteration
    "static": (Net, dict(static_graph=True, **SMALL), None, 1),
    "views": (Net, dict(gradient_as_bucket_view=True, **SMALL), None, 2),
}


def forms(rank, world_size, case):
    make, opts, use_b, steps = CASES[case]
    out = {}
    for form in ("eager", "outer", "inner"):
        for name, wrap, kw in (("gradsync", gradsync.DDP, opts), ("torch", TorchDDP, _for_torch(opts))):
            model, run = build(form, wrap, make(), **kw)
            out[form, name] = windows(model, run, rank, world_size, steps=steps, use_b=use_b)
    return out


def _for_torch(opts):
    # torch's Dynamo DDP optimizer asserts its 1 MiB first bucket is at most bucket_cap_mb: torch
    # fails under compile with small caps (gradsync caps the first split at bucket_cap_mb instead)
    return {k: v for k, v in opts.items() if k != "bucket_cap_mb"}


def check_forms(case):
    results = run_ranks(forms, 2, case, timeout=120, pg_timeout=COMPILING)
    for out in results:
        for history in out.values():
            for got, want in zip(history, out["eager", "gradsync"]):
                assert_close_dicts(got, want)
            assert len(history) == 2
    assert_close_dicts(results[0]["outer", "gradsync"][-1], results[1]["outer", "gradsync"][-1], atol=0, rtol=0)


def test_compile_forms_match_eager_and_torch():
    check_forms("plain")


def test_compile_forms_with_find_unused_parameters():
    check_forms("unused")


def test_compile_forms_with_static_graph():
    check_forms("static")


def test_compile_forms_with_gradient_as_bucket_view():
    check_forms("views")


# ---------------------------------------------------------------- no recompiles across micro-steps
def micro_steps(rank, world_size, form, how):
    """3 windows of 4 micro-steps (no_sync, or the accumulator); after the first window a recompile raises."""
    model, run = build(form, gradsync.DDP, Net(), **SMALL)
    acc = gradsync.GradientAccumulator(run, steps=4) if how == "accumulator" else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    counters = torch._dynamo.utils.counters
    counters.clear()
    graphs = []
    for k, (x, y) in enumerate(batches(12, world_size)):
        xs, ys, last = shard(x, rank, world_size), shard(y, rank, world_size), k % 4 == 3
        with torch._dynamo.config.patch(error_on_recompile=k >= 4):
            if acc is not None:
                with acc.accumulate():
                    acc.backward(F.mse_loss(run(xs), ys))
            else:
                with contextlib.nullcontext() if last else model.no_sync():
                    (F.mse_loss(run(xs), ys) / 4).backward()
        if last:
            opt.step()
            opt.zero_grad()
            graphs.append(counters["stats"]["unique_graphs"])
    return graphs, dict(counters["recompiles"]), model.reducer.sync_count, params(model.module)


def test_no_recompiles_across_micro_steps_and_windows():
    want = run_ranks(micro_steps, 2, "eager", "no_sync")[0][3]
    for form in ("outer", "inner"):
        for how in ("no_sync", "accumulator"):
            results = run_ranks(micro_steps, 2, form, how, timeout=120, pg_timeout=COMPILING)
            for graphs, recompiles, syncs, weights in results:
                assert graphs[0] > 0 and graphs == graphs[:1] * 3 and not recompiles, (form, how, graphs)
                assert syncs == 3, (form, how)  # one reduction per window, not one per micro-step
                assert_close_dicts({n.replace("_orig_mod.", ""): w for n, w in weights.items()}, want)


# ---------------------------------------------------------------- compiled autograd, inductor
def compiled_gradsync_functions() -> list[str]:
    """gradsync's functions Dynamo compiled frames of: its layers only (Chunked), never the wrapper, the engine or
    the adapter, which run eagerly as torch's DDP does, even called from a backward inside a compiled function."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    found = []
    for name, module in list(sys.modules.items()):
        if name.startswith("gradsync") and name != "gradsync.chunked":
            for obj in list(vars(module).values()):
                members = vars(obj).values() if inspect.isclass(obj) else [obj]
                found += [f"{name}.{f.__qualname__}" for f in members if inspect.isfunction(f)
                          and f.__code__.co_filename == module.__file__  # not contextlib's helper
                          and _debug_get_cache_entry_list(f.__code__)]
    return found


def compiled_step(rank, world_size, wrap, autograd, backend):
    # torch's DDP needs its Python reducer under compiled autograd (its C++ reducer raises)
    mode = "python_reducer" if autograd and wrap is TorchDDP else True
    torch._dynamo.utils.counters.clear()
    history = []
    with torch._dynamo.config.patch(compiled_autograd=autograd, optimize_ddp=mode):  # read by torch.compile
        model, _ = build("eager", wrap, Net(), **({} if wrap is TorchDDP else SMALL))

        @torch.compile(backend=backend)
        def step(x, y):  # compiled autograd traces the backward of a compiled function
            F.mse_loss(model(x), y).backward()

        for x, y in batches(2, world_size):
            step(shard(x, rank, world_size), shard(y, rank, world_size))
            history.append(unwrapped(model))
            model.zero_grad(set_to_none=True)
    return history, torch._dynamo.utils.counters["compiled_autograd"]["captures"], compiled_gradsync_functions()


def test_compiled_autograd_and_inductor_match_eager():
    want = run_ranks(windows_eager, 2)[0]
    for wrap, autograd, backend in ((gradsync.DDP, True, BACKEND), (TorchDDP, True, BACKEND),
                                    (gradsync.DDP, False, "inductor")):
        for history, captures, compiled in run_ranks(compiled_step, 2, wrap, autograd, backend, timeout=120, pg_timeout=COMPILING):
            assert captures >= autograd, (wrap, backend)
            assert not compiled, (wrap, backend, compiled)
            for got, ref in zip(history, want, strict=True):
                assert_close_dicts(got, ref)


def windows_eager(rank, world_size):
    model, run = build("eager", gradsync.DDP, Net(), **SMALL)
    return windows(model, run, rank, world_size, steps=1)


# ---------------------------------------------------------------- overlap under whole-model compile
def overlap(rank, world_size, form, optimize_ddp):
    """Whole-model compile, a bucket per layer: how much of the backward's work is done when the first
    bucket launches? Measured in this thread's CPU time (time.thread_time), not wall time: the CPU
    backward and every hook run on the thread that called backward(), so the share counts work done,
    whatever else the machine runs (a rank preempted for a while adds nothing to it)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    with torch._dynamo.config.patch(optimize_ddp=optimize_ddp):  # False: torch's switch for no splits
        model, run = build(form, gradsync.DDP, Net(width=512, depth=8, features=512), bucket_cap_mb=1)
        launches = []

        def timed(state, bucket):  # the default all-reduce, noting when the bucket launched
            launches.append(time.thread_time())
            return allreduce_hook(state, bucket)

        model.register_comm_hook(None, timed)
        shares = []
        for _ in range(5):  # two warm-up steps: AOT autograd compiles the backward, buckets are re-planned
            x = torch.randn(128, 512).requires_grad_()
            reached_input = []
            x.register_hook(lambda g: reached_input.append(time.thread_time()))
            loss = run(x).square().mean()
            dist.barrier()
            launches.clear()
            start = time.thread_time()
            loss.backward()
            shares.append((launches[0] - start) / (reached_input[0] - start))
    return shares[2:], len(model.reducer.buckets)


def test_first_bucket_launches_before_half_the_compiled_backward():
    for form in ("outer", "inner"):
        for shares, n_buckets in run_ranks(overlap, 2, form, True, timeout=120, pg_timeout=COMPILING):
            assert n_buckets >= 8 and sorted(shares)[1] < 0.5, (form, shares)
    for shares, _ in run_ranks(overlap, 2, "outer", False, timeout=120, pg_timeout=COMPILING):  # no split: all at the end
        assert sorted(shares)[1] > 0.5, shares


def unfinished(rank, world_size):
    """Compiled autograd, find_unused_parameters: `b` only in the no_sync micro-step, on rank 0."""
    with torch._dynamo.config.patch(compiled_autograd=True):
        model, _ = build("eager", gradsync.DDP, Branches(), find_unused_parameters=True, timeout=TIMEOUT)

        @torch.compile(backend=BACKEND)
        def step(x, y, use_b):
            F.mse_loss(model(x, use_b=use_b), y).backward()

        x, y = torch.randn(4, 8), torch.randn(4, 4)
        with model.no_sync():
            step(x, y, rank == 0)
        return outcome(lambda: [step(x, y, False) for _ in range(2)])  # rank 0 raises at the second


def test_compiled_autograd_refuses_a_sync_it_could_not_finish():
    (kind, message, _), other = faults(unfinished)
    assert kind == "RuntimeError" and "compiled autograd" in message, message
    assert other[0] == "SyncError", other  # waited for rank 0's bucket, bounded: no hang, no crash


MiB = 1024 * 1024


class Wide(Net):
    def __init__(self):
        super().__init__(width=512, depth=4)  # 1 MiB per layer: caps 1, 4 and 16 MiB plan distinct buckets


def auto_under_compile(rank, world_size, form):
    from torch._dynamo.backends import distributed as dynamo_ddp
    splits, compile_fn = [], dynamo_ddp.DDPOptimizer.compile_fn

    def recorded(self, gm, example_inputs):  # each compile's split count, as Dynamo's DDP optimizer plans it
        result = compile_fn(self, gm, example_inputs)
        splits.append(len(self.buckets))
        return result
    dynamo_ddp.DDPOptimizer.compile_fn = recorded
    model, run = build(form, gradsync.DDP, Wide(), bucket_cap_mb="auto")
    seen, after = [], 0
    for x, y in batches(20, world_size):
        if model.bucket_choice is not None:
            after += 1
            if after > 2:
                break
        F.mse_loss(run(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
        model.zero_grad(set_to_none=True)
        # Dynamo's DDP optimizer splits graphs at bucket_bytes_cap: it must be the cap in use now
        seen.append((model.bucket_bytes_cap, int(model.reducer.store.caps[0] * MiB)))
    dynamo_ddp.DDPOptimizer.compile_fn = compile_fn
    return seen, model.bucket_choice, model.bucket_bytes_cap, splits, len(model.reducer.buckets)


@pytest.mark.parametrize("form", ["outer", "inner"])
def test_auto_cap_under_compile_splits_the_graph_at_its_choice(form):
    """Dynamo reads the cap only when it compiles a frame: the graph kept the first forward's splits. Once "auto"
    chose, the forward compiles once more, split at the chosen cap."""
    for seen, choice, final, splits, buckets in run_ranks(auto_under_compile, 2, form, timeout=300, pg_timeout=COMPILING):
        assert choice is not None and final == int(choice["bucket_cap_mb"] * MiB)
        assert all(split == used for split, used in seen), seen
        assert len(splits) == 2 and splits[-1] == buckets, (splits, buckets)  # one recompile, at the choice


def test_chunked_dropout_under_inductor_recomputes_the_forwards_mask():
    """Compiled, dropout drew from inductor's generator and the eager recomputation in backward drew another mask:
    the gradient was off by about its own size. The chunks now run eagerly under compile (a graph break)."""
    import torch._dynamo
    torch._dynamo.reset()
    torch.manual_seed(0)
    linear = nn.Linear(16, 16)
    run = torch.compile(gradsync.Chunked(nn.Sequential(linear, nn.Dropout(0.5)), chunks=2), backend="inductor")
    x = torch.randn(8, 16)
    for _ in range(2):
        linear.weight.grad = None
        out = run(x)
        out.sum().backward()
        torch.testing.assert_close(linear.weight.grad, ((out != 0).float() / 0.5).t() @ x)
