"""A ``gradsync`` command run in a fork of the test process, with Popen's verbs.

Why: a launch from a new interpreter spends ~5 CPU-s importing torch twice (the launcher, then its fork
server's preload), which was most of what each failure drill cost. The fork runs the same CLI code on the
same argv and environment; ``tests/tools/test_run.py`` keeps the launch from a new interpreter covered.
"""
from __future__ import annotations

import importlib
import io
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback

from gradsync.tools.elastic import forkserver


class ForkedCLI:
    """``gradsync *argv`` in a child of this process, in its own session, its output in temporary files."""

    def __init__(self, argv: list[str], *, env: dict[str, str] | None = None, cwd: str | None = None) -> None:
        for name in forkserver.PRELOAD:  # imported here once, not by every launch's fork server
            importlib.import_module(name)
        self.args = ["gradsync", *argv]
        self.returncode: int | None = None
        self._out, self._err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:
            _child(list(argv), env, cwd, self._out.fileno(), self._err.fileno())

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                out, err = self.output()
                raise subprocess.TimeoutExpired(self.args, timeout, out, err)
            time.sleep(0.02)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return self.output()

    def output(self) -> tuple[str, str]:
        """What the command and its replicas printed so far: (stdout, stderr)."""
        return tuple(os.pread(f.fileno(), os.fstat(f.fileno()).st_size, 0).decode(errors="replace")
                     for f in (self._out, self._err))

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        """End a launcher still running, its replicas with it (SIGTERM: it ends them; they run in sessions of
        their own), then SIGKILL its session if it has not exited within 10 s; reap it."""
        if self.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.pid, signal.SIGKILL)
                self.wait()


def run_cli(argv: list[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
            timeout: float) -> subprocess.CompletedProcess:
    """subprocess.run(capture_output=True, text=True) for a forked ``gradsync`` command; killed at the timeout."""
    proc = ForkedCLI(argv, env=env, cwd=cwd)
    try:
        out, err = proc.communicate(timeout)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _child(argv: list[str], env: dict[str, str] | None, cwd: str | None, out: int, err: int) -> None:
    """Become what ``python -m gradsync.tools.cli`` would be, run it, and exit with its code; never return."""
    code = 1
    try:
        os.setsid()
        signal.alarm(0)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in (signal.SIGTERM, signal.SIGALRM, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDONLY)
        for fd, target in ((null, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
        os.close(null)
        # pytest's capture replaced these objects; a new interpreter's write to fds 0-2 (PYTHONUNBUFFERED)
        sys.stdin = sys.__stdin__ = open(0, closefd=False)
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        if cwd is not None:
            os.chdir(cwd)
        sys.argv = ["gradsync", *argv]
        from gradsync.tools import cli
        cli.main(argv)
        code = 0
    except SystemExit as exc:
        if isinstance(exc.code, int) or exc.code is None:
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
