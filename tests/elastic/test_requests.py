"""The first member's ``Requests`` thread (``elastic/join.py``) and the end of the process.

A daemon thread still inside a ``TCPStore`` call as the interpreter ends aborts the process ("terminate called
without an active exception", rc 134) once the call returns or fails: a replica that finishes its training while
the coordinator is frozen, and is gone by the time the replica's interpreter ends, must still exit cleanly.
"""
import subprocess
import sys
import textwrap
import time

SCRIPT = textwrap.dedent("""
    import atexit, os, signal, socket, subprocess, sys, time
    from datetime import timedelta
    from types import SimpleNamespace
    import torch.distributed as dist
    from gradsync.elastic.join import Requests

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-c", (
        "import time, torch.distributed as d; from datetime import timedelta; "
        f"s = d.TCPStore('127.0.0.1', {port}, is_master=True, timeout=timedelta(seconds=60)); time.sleep(120)")])
    atexit.register(server.kill)  # runs after Requests.close (atexit is last in, first out): the coordinator goes
    client = None
    for _ in range(200):
        try:
            client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
            break
        except Exception:
            time.sleep(0.05)
    client.add("gradsync/join/count", 3)
    member = SimpleNamespace(joining=False, members=[0], replica_id=0, timeout=timedelta(seconds=60))
    requests = Requests(member, f"127.0.0.1:{port}")
    deadline = time.monotonic() + 30
    while requests.count != 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert requests.count == 3, requests.count
    os.kill(server.pid, signal.SIGSTOP)  # frozen: the thread's next call waits for an answer
    time.sleep(0.5)
    print("exiting", flush=True)
""")


def test_a_replica_exits_cleanly_while_its_requests_thread_waits_on_a_frozen_coordinator():
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    took = time.monotonic() - start
    assert proc.returncode == 0 and "exiting" in proc.stdout, (proc.returncode, proc.stdout, proc.stderr[-3000:])
    assert "terminate called" not in proc.stderr, proc.stderr[-3000:]
    assert took < 60, f"the exit waited {took:.0f} s for the thread"
