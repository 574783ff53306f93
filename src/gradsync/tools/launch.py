"""Run a function on W local ranks: forked processes (spawned for CUDA), file:// rendezvous, bounded in time."""
from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .._torch import OPTIMIZER_IMPORTS, compile_throwaway


class RankError(RuntimeError):
    """A rank raised, died, or ran past the time bound."""


def import_before_forking() -> None:
    """Import what a rank's first torch optimizer imports (seconds of CPU) here, once, so the ranks forked
    next do not each import it again."""
    for name in OPTIMIZER_IMPORTS:
        __import__(name)


def compile_before_forking(*backends: str) -> None:
    """Compile a throwaway function once per ``torch.compile`` backend here, then forget it: what a first compile
    imports and probes (CPU-seconds: Dynamo, AOT autograd, inductor's CPU checks) is paid once, not again by every
    rank forked next. Inductor compiles in this process: a rank forked after its worker pool started would wait on
    that pool forever."""
    compile_throwaway(*backends)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0,
              pg_timeout: float | None = 20.0, backend: str = "gloo", threads: int = 1,
              return_errors: bool = False, start_method: str | None = None) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` forked processes; return their results.

    Each rank joins a fresh process group (file:// store, ``pg_timeout`` seconds; None: torch's
    default, as a user's script gets). A rank's
    exception is re-raised here with its rank number and traceback; ranks still running after
    ``timeout`` seconds are killed. With ``return_errors``, a failed rank's entry in the result
    list is a ``RankError`` instead and nothing is raised. Fork makes a 2-4 rank run cost ~0.1 s instead of seconds;
    ``start_method`` (default: "spawn" for NCCL, else "fork") is "spawn" wherever the ranks use CUDA, which a
    forked child cannot initialize once the parent has touched the driver (``torch.cuda.is_available()`` may);
    spawned ranks import ``fn`` by name, so it must be a module-level function.
    """
    ctx = multiprocessing.get_context(start_method or ("spawn" if backend == "nccl" else "fork"))
    fd, store = tempfile.mkstemp(prefix="gradsync-store-")
    os.close(fd)
    os.unlink(store)  # the file store creates it; a stale file would confuse the rendezvous
    procs, pipes = [], []
    try:
        for rank in range(world_size):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(fn, rank, world_size, args, store, pg_timeout,
                                                    backend, threads, send), daemon=True)
            proc.start()
            send.close()
            procs.append(proc)
            pipes.append(recv)
        return _collect(procs, pipes, timeout, return_errors)
    finally:
        for proc in procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
            proc.join(1)
        if os.path.exists(store):
            os.unlink(store)


def _child(fn, rank, world_size, args, store, pg_timeout, backend, threads, send) -> None:
    code = 0
    try:
        torch.set_num_threads(threads)
        timeout = {} if pg_timeout is None else {"timeout": timedelta(seconds=pg_timeout)}
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank,
                                world_size=world_size, **timeout)
        # gloo connects lazily; without this a rank that returns at once can break a peer's set-up
        dist.barrier()
        result = fn(rank, world_size, *args)
        payload = ("ok", result)
    except BaseException as exc:  # report everything, including SystemExit, to the parent
        payload = ("error", f"{type(exc).__name__}: {exc}", traceback.format_exc())
        code = 1
    try:
        send.send_bytes(pickle.dumps(payload))
    except Exception as exc:
        send.send_bytes(pickle.dumps(("error", f"result of rank {rank} could not be pickled: {exc}", "")))
        code = 1
    os._exit(code)  # skip atexit handlers inherited from the parent (pytest's among them)


def _collect(procs, pipes, timeout: float, return_errors: bool) -> list[Any]:
    deadline = time.monotonic() + timeout
    results: list[Any] = [None] * len(procs)
    pending = set(range(len(procs)))
    errors: list[tuple[int, str, str]] = []
    while pending:
        for rank in sorted(pending):
            if pipes[rank].poll(0.01):
                try:
                    payload = pickle.loads(pipes[rank].recv_bytes())
                except EOFError:
                    payload = ("error", "exited without a result", "")
                pending.discard(rank)
                if payload[0] == "ok":
                    results[rank] = payload[1]
                else:
                    errors.append((rank, payload[1], payload[2]))
            elif not procs[rank].is_alive() and not pipes[rank].poll(0):
                pending.discard(rank)
                errors.append((rank, f"died with exit code {procs[rank].exitcode}", ""))
        if time.monotonic() > deadline:
            for rank in pending:
                errors.append((rank, f"still running after {timeout:g}s and was killed", ""))
            break
    if return_errors:
        for rank, message, tb in errors:
            results[rank] = RankError(f"rank {rank}: {message}\n{tb}")
        return results
    if errors:
        errors.sort()
        rank, message, tb = errors[0]
        others = "".join(f"\n  rank {r}: {m}" for r, m, _ in errors[1:])
        raise RankError(f"rank {rank}: {message}{others}\n--- rank {rank} traceback ---\n{tb}")
    return results
