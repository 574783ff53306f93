"""The threads that make store calls on their own connections (``elastic/identity.py``) and the end of the process.

A daemon thread whose ``TCPStore`` call returns after the interpreter began to end aborts the process ("terminate
called without an active exception", rc 134), and a call to a coordinator that does not answer waits for good. A
replica that finishes while the coordinator is frozen, and gone by the time the replica's interpreter ends, must
still exit cleanly: the first member's ``Requests`` thread (``elastic/join.py``) and a launcher-less replica's
heartbeat (``Liveness``) are ended at exit, their connection shut down if a call is stuck.
"""
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

SERVERS = textwrap.dedent("""
    import atexit, os, signal, socket, subprocess, sys, threading, time
    from datetime import timedelta
    from types import SimpleNamespace
    import torch.distributed as dist

    def server():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-c", (
            "import time, torch.distributed as d; from datetime import timedelta; "
            f"s = d.TCPStore('127.0.0.1', {port}, is_master=True, timeout=timedelta(seconds=60)); time.sleep(120)")])
        atexit.register(proc.kill)  # runs after the handlers registered later (last in, first out): gone at the end
        for _ in range(200):
            try:
                return proc, port, dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
            except Exception:
                time.sleep(0.05)
        raise RuntimeError("no store server")

    def wait_for(condition):
        deadline = time.monotonic() + 30
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert condition()

    def check_threads_ended():  # registered before the code under test: runs after its own exit handler
        alive = [t.name for t in threading.enumerate() if t.name.startswith("gradsync-")]
        print("store threads alive at exit:", alive, flush=True)

    frozen, port, client = server()
""")

REQUESTS = SERVERS + textwrap.dedent("""
    from gradsync.elastic.join import Requests
    client.add("gradsync/join/count", 3)
    atexit.register(check_threads_ended)
    member = SimpleNamespace(joining=False, members=[0], replica_id=0, timeout=timedelta(seconds=60))
    requests = Requests(member, f"127.0.0.1:{port}")
    wait_for(lambda: requests.count == 3)
""")

HEARTBEAT = SERVERS + textwrap.dedent("""
    from gradsync.elastic.identity import Identity, Liveness
    _, _, main_store = server()  # the exit report goes to a store that answers; the beat to the one that freezes
    atexit.register(check_threads_ended)
    liveness = Liveness(f"127.0.0.1:{port}", Identity(0, 0, 1, 1, -1), main_store, reports=True)
    wait_for(lambda: client.check(["gradsync/beat/0/0"]))
""")

FREEZE_AND_EXIT = textwrap.dedent("""
    os.kill(frozen.pid, signal.SIGSTOP)  # the thread's next call waits for an answer
    time.sleep(0.7)
    print("exiting", flush=True)
""")


@pytest.mark.parametrize("script", [REQUESTS, HEARTBEAT], ids=["requests", "heartbeat"])
def test_a_replica_exits_cleanly_while_its_store_thread_waits_on_a_frozen_coordinator(script):
    """Timed from the script's last line, not its start: two interpreters importing torch on a loaded machine took
    more than the thread's 60 s timeout, which a stuck exit would wait."""
    # stderr to a file and stdout read to its end here: communicate() after readline() would lose what readline's
    # buffer already held (the line the exit handler prints)
    with tempfile.TemporaryFile("w+") as errors:
        proc = subprocess.Popen([sys.executable, "-c", script + FREEZE_AND_EXIT], stdout=subprocess.PIPE,
                                stderr=errors, text=True)
        try:
            seen = []
            for line in iter(proc.stdout.readline, ""):
                seen.append(line)
                if line.startswith("exiting"):
                    break
            exiting = time.monotonic()
            proc.wait(timeout=120)
            took, stdout = time.monotonic() - exiting, "".join(seen) + proc.stdout.read()
        finally:
            proc.kill()
        errors.seek(0)
        err = errors.read()
    assert proc.returncode == 0 and "exiting" in stdout, (proc.returncode, stdout, err[-3000:])
    assert "terminate called" not in err, err[-3000:]
    assert "store threads alive at exit: []" in stdout, stdout
    assert took < 30, f"the exit waited {took:.0f} s for the thread"
