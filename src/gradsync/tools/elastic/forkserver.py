"""Start replicas with torch already imported: a fork server for ``gradsync run``.

A new interpreter spends 2-5 CPU-seconds importing torch, and its first optimizer imports
``torch._dynamo`` (about 2 more). A replica that restarts pays that on the recovery path. The
launcher forks this server before it starts any thread (the store's server is one); the server
imports what every replica would, then forks each replica from itself, so a replica starts in
milliseconds with the same modules a fresh ``python script.py`` would have imported.

Every replica is a child of the launcher, as with ``subprocess.Popen``: the launcher makes itself
a child subreaper, and the server forks each replica through a short-lived middle process, so the
replica is handed to the launcher when the middle one exits; the replica starts only once the
server has reaped the middle. The launcher then waits for it with ``waitpid`` and reads its exit
code as it would a ``Popen``'s; orphans of a replica's own children come to the launcher too, and
it reaps them.

A process forked after its parent asked the CUDA driver anything (``torch.cuda.is_available()`` does)
cannot use CUDA: a replica forked so replaces itself with a new interpreter, as ``--fresh-interpreters``
would have started it.
"""
from __future__ import annotations

import ctypes
import json
import os
import runpy
import signal
import subprocess
import sys
import warnings

from ..._torch import OPTIMIZER_IMPORTS, cuda_fork_poisoned

PRELOAD = ("torch", "torch.distributed", *OPTIMIZER_IMPORTS, "gradsync")
_PR_SET_CHILD_SUBREAPER, _PR_SET_PDEATHSIG = 36, 1


def supported() -> bool:
    return sys.platform.startswith("linux") and hasattr(os, "fork")


# argv: the launcher's pid, then the replica's command line. The death signal outlives the exec, so the replica
# is a plain `python script.py` that still ends with its launcher (Popen's preexec_fn is unsafe with threads)
_DIE_WITH_LAUNCHER = ("import ctypes, os, sys\n"
                      f"ctypes.CDLL(None).prctl({_PR_SET_PDEATHSIG}, {int(signal.SIGTERM)}, 0, 0, 0)\n"
                      "if os.getppid() != int(sys.argv[1]): os._exit(1)\n"
                      "os.execv(sys.argv[2], sys.argv[2:])\n")


def new_interpreter(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    """``python *argv`` as the launcher's child, which (on Linux) gets SIGTERM when the launcher dies, even SIGKILLed."""
    command = [sys.executable, *argv]
    if supported():
        command = [sys.executable, "-I", "-S", "-c", _DIE_WITH_LAUNCHER, str(os.getpid()), *command]
    return subprocess.Popen(command, env=env, start_new_session=True)


class Forked:
    """A replica forked by the server: the part of ``subprocess.Popen`` the launcher uses."""

    def __init__(self, server: ForkServer, pid: int):
        self.server, self.pid, self.returncode = server, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.reap().pop(self.pid, None)
        return self.returncode

    def wait(self) -> int:
        while self.poll() is None:
            self.server.reap(block=True)
        return self.returncode


class ForkServer:
    """Fork replicas from a process that has imported ``PRELOAD``; start it before any thread."""

    def __init__(self) -> None:
        if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
        self.replicas: set[int] = set()  # running replicas' pids; other children are reaped and forgotten
        self.exited: dict[int, int] = {}
        requests, self._requests = os.pipe()
        self._replies, replies = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the server: _serve returns only in a replica, which becomes the script
            os.close(self._requests)
            os.close(self._replies)
            _run(**_serve(requests, replies))
        os.close(requests)
        os.close(replies)
        self._reply_file = os.fdopen(self._replies, "r")

    def spawn(self, argv: list[str], env: dict[str, str]) -> Forked:
        """Start ``python argv[0] argv[1:]`` with ``env``, in a new session, as this process's child."""
        try:
            os.write(self._requests, (json.dumps({"argv": argv, "env": env}) + "\n").encode())
            line = self._reply_file.readline()
        except OSError as exc:
            raise RuntimeError(f"gradsync run: the fork server is gone ({exc})") from exc
        if not line or int(line) < 0:
            raise RuntimeError("gradsync run: the fork server could not start a replica (it exited or was killed)")
        self.replicas.add(int(line))
        return Forked(self, int(line))

    def reap(self, block: bool = False) -> dict[int, int]:
        """Reap every child that ended; keep the replicas' exit codes (negative: the signal), keyed by pid."""
        flags = 0 if block else os.WNOHANG
        while True:
            try:
                pid, status = os.waitpid(-1, flags)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid in self.replicas:  # not an orphan of a replica's own children: their pids may come back
                self.replicas.discard(pid)
                self.exited[pid] = os.waitstatus_to_exitcode(status)
            flags = os.WNOHANG  # one blocking wait at most
        return self.exited

    def close(self) -> None:
        """End the server (it exits when its request pipe closes) and reap it."""
        os.close(self._requests)
        self._reply_file.close()
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass  # reaped already


def _serve(requests: int, replies: int) -> dict:
    """Fork a replica per request; return its request in the replica, and never in the server."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the launcher's group: the launcher decides
        launcher = os.getppid()
        for name in PRELOAD:
            __import__(name)
        pending = b""
        while True:
            while b"\n" not in pending:
                chunk = os.read(requests, 1 << 16)
                if not chunk:
                    os._exit(0)  # the launcher closed the pipe: it is done or gone
                pending += chunk
            line, pending = pending.split(b"\n", 1)
            handoff_r, handoff_w = os.pipe()  # the middle tells the server the replica's pid
            go_r, go_w = os.pipe()  # the server tells the replica it is the launcher's child now
            middle = os.fork()
            if middle == 0:
                replica = os.fork()
                if replica == 0:
                    for fd in (handoff_r, handoff_w, go_w, requests, replies):
                        os.close(fd)
                    os.read(go_r, 1)  # a byte, or EOF if the server is gone: start as Popen's child would
                    os.close(go_r)
                    # the launcher's child now: SIGTERM when it dies, even SIGKILLed, so that no replica outlives it
                    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
                    if os.getppid() != launcher:  # it died before that
                        os._exit(1)
                    return json.loads(line)
                os.write(handoff_w, f"{replica}\n".encode())
                os._exit(0)  # the replica is handed to the launcher, the subreaper
            for fd in (handoff_w, go_r):
                os.close(fd)
            pid = os.read(handoff_r, 64) or b"-1\n"
            os.close(handoff_r)
            os.waitpid(middle, 0)  # reaped: the replica is the launcher's child before the launcher hears of it
            try:
                os.write(go_w, b"1")
            except OSError:  # no replica reads it: it was not forked, or was killed already
                pass
            os.close(go_w)
            os.write(replies, pid)
    except BaseException:  # the server and the middle never return into the launcher's code
        os._exit(1)


def _run(argv: list[str], env: dict[str, str]) -> None:
    """Become ``python argv[0] argv[1:]``: the script's SystemExit or exception ends the process."""
    os.setsid()  # as Popen(start_new_session=True): the launcher signals the replica's whole group
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(env)
    if cuda_fork_poisoned():  # a parent asked the CUDA driver before the fork: only a new interpreter can use it
        os.execve(sys.executable, [sys.executable, *argv], env)
    torch = sys.modules["torch"]
    # the first use of torch's thread pool after a fork replaces the parent's, and two threads racing to it see none
    # (a comm hook's callback on gloo's thread raised "Invalid thread pool!"): make that first use here, alone
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch says it leaks the parent's pool
        torch.set_num_threads(torch.get_num_threads())
    # a new interpreter seeds torch's and numpy's global generators from the OS (Python's random reseeds at fork)
    torch.default_generator.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:  # the script's own raise, through sys.exit: an elastic replica's Liveness records it
        sys.exit(exc.code)
    raise SystemExit(0)
