"""The elastic drills' training script, run as replicas by ``gradsync run`` (tests/elastic/test_elastic.py).

Replica ``--victim`` SIGKILLs itself at ``--point`` of window ``--window``; every replica writes its
final parameters, members and events to ``--out``/<id>.pt. The micro-batch of (replica, window,
micro-step) is a function of those three, so one process can train on exactly what was kept.
"""
import argparse
import ast
import dataclasses
import os
import signal
import socket
import sys
import time

import torch

import gradsync

POINTS = ["forward", "freeze", "freeze_during_reductions", "freeze_in_step", "local_backward", "before_reductions", "during_reductions", "after_reductions",
          "after_commit", "optimizer_step", "step_vote", "mirror_pass", "corrupt", "auto_gather", "audit", "none"]


def build_model(buffers: bool = False, width: int = 16, spare: bool = False) -> torch.nn.Module:
    """With ``buffers``, a BatchNorm: every training forward broadcasts rank 0's running statistics. A
    ``width`` of 512 makes a 1 MiB weight: bucket_cap_mb="auto" then has two layouts to time. With ``spare``, a
    parameter that the forward never uses (its bucket is the one skip_all_reduce_unused_params skips)."""
    torch.manual_seed(0)
    middle = torch.nn.BatchNorm1d(width) if buffers else torch.nn.Identity()
    net = torch.nn.Sequential(torch.nn.Linear(8, width), middle, torch.nn.Tanh(), torch.nn.Linear(width, width),
                              torch.nn.Tanh(), torch.nn.Linear(width, 4))
    if spare:
        net.register_parameter("spare", torch.nn.Parameter(torch.randn(4)))
    return net


def micro_batch(replica: int, window: int, step: int, items: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100_000 + replica * 1000 + window * 10 + step)
    rows = int(torch.randint(1, 7, (1,), generator=g)) if items else 4
    return torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g)


def dataset(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.25, momentum=0.5)


ADAMW = dict(lr=0.01, weight_decay=0.1)  # --sharded: ShardedOptimizer(model, torch.optim.AdamW, **ADAMW)
CLIP = 0.3  # --clip: the window's gradient clipped to this global norm before each step


KILL_LAUNCHER = False  # --kill-launcher: the victim takes its launcher with it, as a machine that dies


def die() -> None:
    if KILL_LAUNCHER:
        os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def hold(joiners: int) -> None:
    """While the job is short of members, wait until ``joiners`` replicas asked to join (ever): the members
    then admit them together at the next boundary."""
    m = gradsync.elastic.membership.membership()
    deadline = time.monotonic() + 60
    while joiners and not m.joining and m.store.add("gradsync/join/count", 0) < joiners:
        assert time.monotonic() < deadline, f"{joiners} replicas did not ask to join within 60 s"
        time.sleep(0.01)
    if joiners:  # the first member's Requests thread reads them before this window's synced backward carries them
        time.sleep(3 * gradsync.elastic.join.REQUESTS_S)


def refusals() -> int:
    return gradsync.elastic.membership.membership().store.add("gradsync/join/refusals", 0)


def freeze(out: str) -> None:
    """SIGSTOP this process (its heartbeat thread too); the drill sends SIGCONT once the others went on."""
    with open(os.path.join(out, "frozen.pid"), "w") as f:
        f.write(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGSTOP)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--victim", default="-1")
    parser.add_argument("--window", type=int, default=1)
    parser.add_argument("--point", choices=POINTS, default="none")
    parser.add_argument("--items", action="store_true", help="sum losses with num_items, uneven micro-batches")
    parser.add_argument("--plain", action="store_true", help="no accumulator: loss.backward() and a step each window")
    parser.add_argument("--sampler", type=int, default=0, help="draw from a dataset of this many samples "
                        "through gradsync.elastic.ElasticSampler")
    parser.add_argument("--global-batch", type=int, default=None, help="with --sampler: samples per window")
    parser.add_argument("--until-full", type=int, default=0, help="go on past --windows until this many members")
    parser.add_argument("--admit-together", type=int, default=0, help="members wait at a boundary until this "
                        "many join requests were made (ever), so they are admitted together")
    parser.add_argument("--until-refused", type=int, default=0, help="go on until this many replicas were "
                        "refused at admission, then stop (SIGUSR1 to itself: gradsync.elastic.stopping)")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds at each window's start (a slower job)")
    parser.add_argument("--kill-launcher", action="store_true", help="the victim kills its launcher too")
    parser.add_argument("--buffers", action="store_true", help="a model with buffers, broadcast at every forward")
    parser.add_argument("--kill-step", type=int, default=None, help="the micro-step of a forward kill (default: last)")
    parser.add_argument("--check-replicas", default="", help="DDP's check_replicas (\"evict\" or \"1\"); with "
                        "--point corrupt the victim flips a parameter bit at --window's first micro-step instead of dying")
    parser.add_argument("--kill-delay", type=float, default=0.0, help="during_reductions: seconds before the kill")
    parser.add_argument("--hook", choices=["bf16", "powersgd"], default=None, help="a comm hook on the default group "
                        "(powersgd: torch's, rank 1, compressing from the third synced backward)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the DDP model")
    parser.add_argument("--overlap", action="store_true", help="gradsync.overlap_optimizer(model, optimizer)")
    parser.add_argument("--width", type=int, default=16, help="the model's hidden width")
    parser.add_argument("--sync-each-batch", action="store_true", help="GradientAccumulator(sync_each_batch=True)")
    parser.add_argument("--backend", default="gloo", help="gradsync.elastic.init_process_group's backend")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: replica r on GPU r % count")
    parser.add_argument("--bf16", action="store_true", help="bf16 parameters and data, reduce_dtype=torch.float32")
    parser.add_argument("--sharded", action="store_true", help="ShardedDataParallel + ShardedOptimizer(AdamW)")
    parser.add_argument("--victim2", type=int, default=-1, help="--sharded: a replica that dies as it is about to "
                        "contribute to the first re-shard")
    parser.add_argument("--dies-after-reform", type=int, default=-1, help="a replica that dies as the first re-form "
                        "ends, its new group formed, before it reports how long the re-form took")
    parser.add_argument("--clip", action="store_true", help="clip_grad_norm_(model.parameters(), CLIP) before each step "
                        "(after the optimizer_step point: a kill there is found in its all-reduce)")
    parser.add_argument("--scaler", action="store_true", help="--sharded: gradsync.ShardedGradScaler with a fixed "
                        "power-of-two scale (exact); its unscale_ comes after the optimizer_step point, so a kill there is "
                        "found in its all-reduce")
    parser.add_argument("--skip", action="append", default=[], help="REPLICA,WINDOW,MICRO_STEP: that replica skips "
                        "that micro-step (acc.skip)")
    parser.add_argument("--exit-code", type=int, default=0, help="sys.exit() with it at the end")
    parser.add_argument("--raise-exit", action="store_true", help="raise SystemExit(--exit-code) instead")
    parser.add_argument("--delay", action="store_true", help="delay_all_reduce_named_params: the last layer's")
    parser.add_argument("--spare", action="store_true", help="a parameter the forward never uses")
    parser.add_argument("--audit", action="store_true", help="gradsync.audit after each window's step (point audit: "
                        "the victim dies inside it, after its micro-batch arrived)")
    parser.add_argument("--ddp", action="append", default=[], help="a DDP option as NAME=VALUE (Python literal), "
                        "e.g. gradient_as_bucket_view=True, bucket_cap_mb='auto'")
    parser.add_argument("--noise", action="store_true", help="noise_scale=True; record it and sync_report() per window")
    parser.add_argument("--timeout", type=float, default=30, help="gradsync.elastic.init_process_group's timeout")
    parser.add_argument("--lag-pass", default="", help="--sharded: REPLICA,WINDOW,SECONDS: that replica is late to the "
                        "window's last mirrored pass (as a descheduled process)")
    args = parser.parse_args()
    global KILL_LAUNCHER
    KILL_LAUNCHER = args.kill_launcher
    gradsync.elastic.init_process_group(args.backend, timeout=args.timeout)
    me = gradsync.elastic.replica_id()
    device = torch.device("cpu") if args.device == "cpu" else torch.device("cuda", me % torch.cuda.device_count())
    # --victim is a replica id, or GROUP:LOCAL_RANK under a launcher that assigns no ids (torchrun)
    where = f"{os.environ.get('GRADSYNC_GROUP') or socket.gethostname()}:{os.environ.get('LOCAL_RANK')}"
    victim = args.victim in (str(me), where) and gradsync.elastic.membership.membership().restart == 0
    if "GRADSYNC_REPLICA_ID" not in os.environ:  # a record of every start, for the launcher drills
        open(os.path.join(args.out, f"start-{where}-{os.getpid()}"), "w").close()

    net = build_model(args.buffers, args.width, args.spare).to(device, torch.bfloat16 if args.bf16 else torch.float32)
    # one bucket per parameter: a kill between two buckets' all-reduces is a real point
    check = {"": False, "1": True}.get(args.check_replicas, args.check_replicas)
    options = dict(bucket_cap_mb=1e-6, first_bucket_cap_mb=1e-6, check_replicas=check)
    options.update((k, ast.literal_eval(v)) for k, v in (o.split("=", 1) for o in args.ddp))
    options.update(reduce_dtype=torch.float32) if args.bf16 else None
    if args.delay:
        options.update(delay_all_reduce_named_params=[(n, p) for n, p in net.named_parameters() if n.startswith("5.")],
                       param_to_hook_all_reduce=net[0].weight)
    model = (gradsync.ShardedDataParallel if args.sharded else gradsync.DistributedDataParallel)(net, **options)
    assert model.delayed is None or not args.delay, "an elastic member reduces the delayed parameters in its buckets"
    if args.hook == "bf16":  # state None: the default group, which follows membership
        model.register_comm_hook(None, gradsync.hooks.bf16_compress_hook)
    if args.hook == "powersgd":  # process_group=None: the default group too
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
        state = powersgd.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2, random_seed=0)
        model.register_comm_hook(state, powersgd.powerSGD_hook)
    forward = torch.compile(model) if args.compile else model
    steps = 1 if args.plain else args.steps
    acc = None if args.plain else gradsync.GradientAccumulator(model, steps=steps, sync_each_batch=args.sync_each_batch,
                                                                noise_scale=args.noise)
    optimizer = gradsync.ShardedOptimizer(model, torch.optim.AdamW, **ADAMW) if args.sharded else \
        make_optimizer(model.parameters())
    if args.overlap:
        gradsync.overlap_optimizer(model, optimizer)
    if not args.plain:
        optimizer = acc.wrap_optimizer(optimizer)
    scaler = gradsync.ShardedGradScaler(device.type, init_scale=2.0 ** 8, growth_interval=10 ** 6) if args.scaler else None
    state = {"window": -1, "step": -1, "last": False}
    audits = []  # (window, whether its audit completed)
    observed = []  # --noise: (window, acc.noise_scale, model.sync_report()) after each window's step

    def at(point: str, step: int | str | None = None) -> bool:
        """Whether the victim is at ``point`` of micro-step ``step`` ("last": the window's synced one)."""
        here = state["last"] if step == "last" else step is None or state["step"] == step
        return victim and args.point == point and state["window"] == args.window and here

    kill_step = "last" if args.kill_step is None else args.kill_step
    net.register_forward_pre_hook(lambda *_: die() if at("forward", kill_step) else None)
    net.register_forward_pre_hook(lambda *_: freeze(args.out) if at("freeze", kill_step) else None)
    if victim and args.point in ("during_reductions", "freeze_during_reductions"):  # after the header and the first bucket
        calls = []

        def counted(collective):
            def call(*a, **k):
                if at(args.point, "last"):
                    calls.append(1)
                    if len(calls) == 3:
                        time.sleep(args.kill_delay)  # the others have the earlier buckets' results by then
                        freeze(args.out) if args.point == "freeze_during_reductions" else die()
                return collective(*a, **k)
            return call
        torch.distributed.all_reduce = counted(torch.distributed.all_reduce)
        if args.sharded:  # on CPU its buckets are exchanged by all-to-all (sharded/comm.py)
            torch.distributed.all_to_all_single = counted(torch.distributed.all_to_all_single)
    if victim and args.point in ("after_reductions", "after_commit"):
        membership = gradsync.elastic.membership.StoreMembership
        commit = membership.commit

        def vote(self, sync):
            if at("after_reductions"):
                die()
            decided = commit(self, sync)
            if at("after_commit"):
                die()
            return decided
        membership.commit = vote

    if victim and args.point == "step_vote":  # --sharded: after the step's all-gathers, before its vote
        agree = gradsync.engine.protocol.Attachment.agree
        gradsync.engine.protocol.Attachment.agree = lambda self, what: die() if at("step_vote") else agree(self, what)
    if victim and args.point == "freeze_in_step":  # --sharded: between the step's first and second all-gather
        import gradsync.sharded.optim as sharded_optim
        start, gathers = sharded_optim.start_all_gather, []

        def gather(*a, **k):
            if at("freeze_in_step", "last"):
                gathers.append(1)
                if len(gathers) == 2:
                    freeze(args.out)
            return start(*a, **k)
        sharded_optim.start_all_gather = gather
    if victim and args.point == "mirror_pass":  # --sharded: the first bucket's all-to-all is in, its pass not sent
        import gradsync.sharded.launcher as sharded_launcher
        pass_on = sharded_launcher.pass_on
        sharded_launcher.pass_on = lambda *a: die() if at("mirror_pass", "last") else pass_on(*a)
    if args.lag_pass and int(args.lag_pass.split(",")[0]) == me:
        import gradsync.sharded.launcher as sharded_launcher
        lag_window, lag = int(args.lag_pass.split(",")[1]), float(args.lag_pass.split(",")[2])
        passed, lagged = sharded_launcher.pass_on, []

        def late(store, bucket, group):  # its last bucket's: the others have passed theirs and wait for it
            if state["window"] == lag_window and bucket is store.buckets[-1] and not lagged:
                lagged.append(time.sleep(lag))
                print(f"replica {me} lagged {lag} s before a pass in window {lag_window}", file=sys.stderr, flush=True)
            return passed(store, bucket, group)
        sharded_launcher.pass_on = late
    if args.dies_after_reform == me:
        membership = gradsync.elastic.membership.StoreMembership
        slowest = membership.slowest
        membership.slowest = lambda self, seconds: die() if self.generation >= 1 else slowest(self, seconds)
    if args.victim2 == me:  # inside the re-shard that the first death started: the others are gathering
        import gradsync.sharded.regroup as regroup
        held = regroup.held
        regroup.held = lambda store: die() if gradsync.elastic.membership.membership().generation >= 1 else held(store)
    if victim and args.point == "auto_gather":  # inside the collective that gathers "auto"'s timings
        gather = gradsync.engine.autocap.AutoCaps.gather
        gradsync.engine.autocap.AutoCaps.gather = lambda self: die() if state["window"] == args.window else gather(self)

    processed, sampler, memory = [], None, []

    def micro_steps():  # (window, micro-step, x, y); with an accumulator, its state says where the job is
        nonlocal sampler
        if args.plain:
            yield from ((w, 0, *micro_batch(me, w, 0, args.items)) for w in range(args.windows))
            return
        if args.sampler:  # each window's global batch dealt across the members of that window
            xs, ys = dataset(args.sampler)
            sampler = gradsync.elastic.ElasticSampler(args.sampler, micro_batch=4, seed=3,
                                                      global_batch=args.global_batch, steps=None if args.global_batch else steps)
            for idx in sampler.iterate(acc):
                with acc.accumulate():
                    processed.append((acc.windows - 1, idx))
                    yield acc.windows - 1, acc.micro_step, xs[idx], ys[idx]
            return
        # with --until-full the members go on, together, until the replica that rejoins is back: the
        # test does not depend on how long a restart takes on a loaded machine
        asked = False
        while not (acc.is_boundary and acc.windows >= args.windows
                   and len(gradsync.elastic.members()) >= args.until_full and not args.until_refused):
            hold(args.admit_together if len(gradsync.elastic.members()) < args.until_full else 0)
            if args.until_refused and not asked and refusals() >= args.until_refused:
                os.kill(os.getpid(), signal.SIGUSR1)  # members read the count apart: stop where all agree
                asked = True
            if acc.is_boundary and gradsync.elastic.stopping(acc):  # SIGUSR1: every member stops here
                break
            with acc.accumulate():  # a replica that joins gets the members' state here
                if f"{me},{acc.windows - 1},{acc.micro_step}" in args.skip:
                    acc.skip("drill")
                yield acc.windows - 1, acc.micro_step, *micro_batch(me, acc.windows - 1, acc.micro_step, args.items)

    for w, k, x, y in micro_steps():
        x, y = (x.bfloat16(), y.bfloat16()) if args.bf16 else (x, y)
        x, y = x.to(device), y.to(device)
        time.sleep(args.sleep if k == 0 else 0)
        state.update(window=w, step=k, last=args.plain or acc.is_boundary)
        if at("corrupt", 0):  # a silent fault: one flipped bit in this replica's parameters
            with torch.no_grad():
                net[3].weight.view(-1).view(torch.int32)[5] ^= 1 << 12
        out = forward(x)
        loss = torch.nn.functional.mse_loss(out, y, reduction="sum" if args.items else "mean")
        if at("local_backward", 0) or at("before_reductions", "last"):
            loss.register_hook(lambda g: die())
        loss = loss if scaler is None else scaler.scale(loss)
        if args.plain:
            loss.backward()
        else:
            acc.backward(loss, num_items=x.shape[0] if args.items else None)
        if (args.plain or acc.is_boundary) and at("optimizer_step"):
            die()
        if scaler is not None and (args.plain or acc.is_boundary):
            scaler.unscale_(optimizer)
        if args.clip and (args.plain or acc.is_boundary):
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        if scaler is not None and (args.plain or acc.is_boundary):
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
        if args.audit and (args.plain or acc.is_boundary):
            def audit_loss(module, batch):
                if at("audit"):
                    die()
                return torch.nn.functional.mse_loss(module(batch[0]), batch[1])
            batch = tuple(t.to(device) for t in micro_batch(0, w, 0, False))
            audits.append((w, gradsync.audit(model, audit_loss, batch).complete))
        if args.noise and acc.is_boundary:
            observed.append((w, acc.noise_scale, repr(model.sync_report())))
        if args.plain or acc.is_boundary:  # what the collectives were given: buckets, or sharded, the parameters
            memory.append((gradsync.elastic.membership.membership().generation, sorted(
                b.flat_param.data_ptr() if args.sharded else (b.buffer if b.wire is None else b.wire).data_ptr()
                for b in model.reducer.store.buckets)))
    events = [dataclasses.asdict(e) for e in gradsync.elastic.events()]
    torch.save({"params": [p.detach().cpu().clone() for p in net.parameters()], "members": gradsync.elastic.members(),
                "bucket_choice": model.bucket_choice, "buckets": model.reducer.bucket_plan(),
                "buckets_reduced": model.reducer.skips.reduced,
                "events": events, "processed": processed, "lost": sampler.lost if sampler else None,
                "windows": args.windows if acc is None else acc.windows, "optimizer": optimizer.state_dict(),
                "memory": memory, "audits": audits, "observed": observed,
                "timeout": model.reducer.config.timeout.total_seconds()}, os.path.join(args.out, f"{me}.pt"))
    if args.exit_code and args.raise_exit:
        raise SystemExit(args.exit_code)
    if args.exit_code:
        sys.exit(args.exit_code)


if __name__ == "__main__":
    main()
