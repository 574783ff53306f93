"""`gradsync run`: replicas get their ids and arguments, dead ones restart, the job ends cleanly."""
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from forked_cli import ForkedCLI
from gradsync.tools import cli
from gradsync.tools.elastic import run

SRC = str(Path(run.__file__).resolve().parents[2])
ENV = {**os.environ, "PYTHONPATH": SRC}  # this checkout, as conftest.py does
BOUND_S = 120

# A replica talks to the coordinator only where a test needs it: importing torch costs seconds.
STORE = """
import os
from datetime import timedelta
import torch.distributed as dist
host, port = os.environ["GRADSYNC_COORDINATOR"].rsplit(":", 1)
store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))
"""


def launch(tmp_path, options, body, script_args=(), *, new_interpreter=False):
    """Start the launcher on a replica script made of ``body``'s parts (each dedented): forked from this
    process (no torch import to pay), or as a user starts it, where a test is about that start."""
    parts = [body] if isinstance(body, str) else body
    script = tmp_path / "replica.py"
    script.write_text("import os, signal, sys, time\n"
                      "rid, restart = int(os.environ['GRADSYNC_REPLICA_ID']), int(os.environ['GRADSYNC_RESTART'])\n"
                      f"out = {str(tmp_path)!r}\n" + "".join(textwrap.dedent(p) for p in parts))
    argv = ["run", *options, str(script), *script_args]
    if not new_interpreter:
        return ForkedCLI(argv, env=ENV, cwd=tmp_path)
    return subprocess.Popen([sys.executable, "-m", "gradsync.tools.cli", *argv], env=ENV, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc):
    try:
        out, err = proc.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the launcher ran past {BOUND_S}s\n{err}")
    return proc.returncode, out, err


def lines(path):
    return sorted(path.read_text().split()) if path.exists() else []


def test_replicas_get_ids_environment_and_arguments(tmp_path):
    body = """
    with open(os.path.join(out, f"env-{rid}"), "w") as f:
        print(repr((rid, restart, os.environ["GRADSYNC_COORDINATOR"], os.environ["GRADSYNC_REPLICAS"],
                    os.environ["GRADSYNC_MIN_REPLICAS"], os.environ["GRADSYNC_MACHINE"], sys.argv[1:],
                    sys.executable)), file=f)
    """
    proc = launch(tmp_path, ["--replicas", "3", "--min-replicas", "2"], body, ["--lr", "1e-3", "x"],
                  new_interpreter=True)
    rc, _, err = finish(proc)
    assert rc == 0, err
    seen = [eval((tmp_path / f"env-{i}").read_text()) for i in range(3)]
    assert [s[0] for s in seen] == [0, 1, 2]
    for _, restart, coordinator, total, least, machine, argv, exe in seen:
        assert (restart, total, least, machine, argv) == (0, "3", "2", "0", ["--lr", "1e-3", "x"])
        assert coordinator.startswith("127.0.0.1:") and coordinator == seen[0][2]
        assert exe == sys.executable


def test_a_failing_replica_restarts_with_the_next_count(tmp_path):
    body = """
    open(os.path.join(out, "starts"), "a").write(f"{restart}\\n")
    sys.exit(1 if restart < 2 else 0)
    """
    rc, _, err = finish(launch(tmp_path, ["--max-restarts", "2"], body))
    assert rc == 0, err
    assert lines(tmp_path / "starts") == ["0", "1", "2"]
    assert "replica 0 (restart 0) exited with code 1; restarting (1 of 2)" in err


def test_a_replica_that_stops_is_killed_and_restarted_each_time(tmp_path):
    """A replica stopped by SIGSTOP for 5 s is SIGKILLed and restarted like a dead one, its restart watched afresh."""
    body = """
    open(os.path.join(out, "starts"), "a").write(f"{restart}\\n")
    if restart < 2:
        os.kill(os.getpid(), signal.SIGSTOP)
    """
    rc, _, err = finish(launch(tmp_path, ["--max-restarts", "2"], body))
    assert rc == 0, err
    assert lines(tmp_path / "starts") == ["0", "1", "2"]
    for restart in (0, 1):
        assert f"replica 0 (restart {restart}) has been stopped (SIGSTOP) for 5 s; killing it" in err, err
        assert f"replica 0 (restart {restart}) died with SIGKILL; restarting ({restart + 1} of 2)" in err, err


def test_restarts_run_out_and_a_killed_replica_is_reported(tmp_path):
    body = ("""
    open(os.path.join(out, f"starts-{rid}"), "a").write(f"{restart}\\n")
    if rid == 0:
        sys.exit(1)
    if restart == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    """, STORE, """
    open(os.path.join(out, "exit-1-0"), "w").write(store.get("gradsync/exit/1/0").decode())
    sys.exit(3)
    """)
    rc, _, err = finish(launch(tmp_path, ["--replicas", "2", "--max-restarts", "1"], body))
    assert rc == 1, err
    assert lines(tmp_path / "starts-0") == ["0", "1"]
    assert lines(tmp_path / "starts-1") == ["0", "1"]
    assert (tmp_path / "exit-1-0").read_text() == "-9"
    assert "replica 1 (restart 0) died with SIGKILL; restarting (1 of 1)" in err
    assert "replica 0 (restart 1) exited with code 1; no restarts left" in err


def test_a_finished_job_ends_a_waiting_joiner(tmp_path):
    body = ("""
    if rid == 0:
        sys.exit(0)
    """, STORE, """
    store.set(f"gradsync/waiting/{rid}", str(restart))
    time.sleep(600)
    """)
    rc, _, err = finish(launch(tmp_path, ["--replicas", "2", "--max-restarts", "2"], body))
    assert rc == 0, err
    assert "replica 1 (restart 0) died with SIGTERM; ended by the launcher" in err


def test_a_failed_job_restarts_nothing(tmp_path):
    body = ("""
    open(os.path.join(out, "starts"), "a").write(f"{restart}\\n")
    """, STORE, """
    store.set("gradsync/job/failed", "below min")
    sys.exit(1)
    """)
    rc, _, err = finish(launch(tmp_path, ["--max-restarts", "3"], body))
    assert rc == 1
    assert lines(tmp_path / "starts") == ["0"]
    assert "below min" in err


def test_launchers_on_two_machines_share_one_coordinator(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    body = """
    open(os.path.join(out, f"machine-{rid}"), "w").write(os.environ["GRADSYNC_MACHINE"])
    """
    options = ["--replicas", "2", "--machines", "2", "--coordinator", f"127.0.0.1:{port}"]
    first = launch(tmp_path, options, body)
    second = launch(tmp_path, options, body)
    results = [finish(first), finish(second)]
    assert [r[0] for r in results] == [0, 0], results
    machines = {rid: (tmp_path / f"machine-{rid}").read_text() for rid in range(4)}
    # ids come in blocks of --replicas, in the order the launchers reached the coordinator
    assert machines[0] == machines[1] != machines[2] == machines[3]


def test_sigterm_to_the_launcher_ends_its_replicas(tmp_path):
    body = """
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # a clean exit here is still no finished job
    open(os.path.join(out, f"pid-{rid}"), "w").write(str(os.getpid()))
    time.sleep(600)
    """
    proc = launch(tmp_path, ["--replicas", "2"], body)
    pids = [tmp_path / f"pid-{rid}" for rid in range(2)]
    deadline = time.monotonic() + BOUND_S
    while not all(p.exists() and p.read_text() for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    rc, _, err = finish(proc)
    assert rc == 143, err
    for p in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(int(p.read_text()), 0)


@pytest.mark.parametrize("argv, message", [
    (["--min-replicas", "0", "s.py"], "--min-replicas must be between 1 and"),
    (["--replicas", "3", "--min-replicas", "5", "s.py"], "--min-replicas must be between 1 and"),
    (["--replicas", "2"], "the following arguments are required: script"),
    (["--machines", "2", "s.py"], "needs --coordinator"),
    (["--coordinator", "127.0.0.1:99999", "s.py"], "a port from 1 to 65535"),  # was an OverflowError traceback
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        run.parse_args(argv)
    assert exit_.value.code != 0
    assert message in capsys.readouterr().err


def test_arguments_after_the_script_reach_it_unchanged():
    args = run.parse_args(["--replicas", "2", "train.py", "--lr", "1e-3", "--replicas", "9", "-h"])
    assert (args.replicas, args.script, args.args) == (2, "train.py", ["--lr", "1e-3", "--replicas", "9", "-h"])


def test_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", "--help"])
    assert exit_.value.code == 0
    assert "--max-restarts" in capsys.readouterr().out


@pytest.mark.parametrize("options", [[], ["--fresh-interpreters"]], ids=["forked", "fresh"])
def test_a_replica_starts_as_a_new_interpreter_would(tmp_path, options):
    """Forked from the launcher's server or not: the script runs as __main__ with its own argv, path, session,
    environment and random seeds, is the launcher's child, runs its atexit handlers, and a traceback ends it."""
    body = """
    import atexit, random
    import numpy, torch
    if rid == 1:
        raise ValueError("replica one fails")
    atexit.register(lambda: open(os.path.join(out, f"atexit-{rid}"), "w").write("ran"))
    with open(os.path.join(out, f"seen-{rid}"), "w") as f:
        print(repr((__name__, sys.argv, sys.path[0], os.getsid(0) == os.getpid(), os.getppid(),
                    os.environ["GRADSYNC_REPLICAS"], random.random(), int(numpy.random.randint(2**31)),
                    torch.initial_seed(), signal.getsignal(signal.SIGINT) is signal.default_int_handler)), file=f)
    """
    proc = launch(tmp_path, ["--replicas", "3", "--min-replicas", "1", *options], body, ["--flag"],
                  new_interpreter=True)
    rc, _, err = finish(proc)
    assert rc == 1, err
    assert "ValueError: replica one fails" in err and "replica 1 (restart 0) exited with code 1" in err
    script = str(tmp_path / "replica.py")
    seen = [eval((tmp_path / f"seen-{i}").read_text()) for i in (0, 2)]
    for name, argv, path0, own_session, parent, total, _, _, seed, sigint in seen:
        assert (name, argv, path0, own_session, parent, total) == ("__main__", [script, "--flag"], str(tmp_path),
                                                                   True, proc.pid, "3")
        assert sigint  # Python's Ctrl-C handler, not the server's
    assert all(seen[0][i] != seen[1][i] for i in (6, 7, 8))  # random, numpy and torch draw their own seeds
    assert [(tmp_path / f"atexit-{i}").read_text() for i in (0, 2)] == ["ran", "ran"]


SLOW_START = """
import json, os, sys, time
from gradsync.tools.elastic import forkserver
real_fork, depth = os.fork, [0]

def fork():  # the third generation (launcher > server > middle > replica) runs late, after the middle is gone
    pid = real_fork()
    if pid == 0:
        depth[0] += 1
        if depth[0] == 3:
            time.sleep(0.5)
    return pid

os.fork = fork
forkserver.PRELOAD = ()  # the replica imports nothing; this test is about its parent
server = forkserver.ForkServer()
script = sys.argv[1]
procs = [server.spawn([script, str(i)], dict(os.environ)) for i in range(3)]
deadline = time.monotonic() + 60
while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
    time.sleep(0.05)
print(json.dumps({"codes": [p.poll() for p in procs], "launcher": os.getpid()}))
for p in procs:  # none left behind, whatever happened
    if p.poll() is None:
        os.kill(p.pid, 9)
server.close()
"""


def test_a_replica_that_starts_late_still_runs_as_the_launchers_child(tmp_path):
    """The replica may first run after the middle process is gone (a loaded machine): it must not wait for a
    parent change it already went through (it hung there once, 1 drill in 6 beside two busy processes)."""
    script = tmp_path / "replica.py"
    script.write_text("import os, sys\nopen(sys.argv[0] + '.' + sys.argv[1], 'w').write(str(os.getppid()))\n")
    done = subprocess.run([sys.executable, "-c", SLOW_START, str(script)], env=ENV, capture_output=True, text=True,
                          timeout=BOUND_S)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["codes"] == [0, 0, 0], done.stderr[-3000:]
    assert [(tmp_path / f"replica.py.{i}").read_text() for i in range(3)] == [str(seen["launcher"])] * 3


POISONED = """
import json, os, sys, time
from gradsync.tools.elastic import forkserver
forkserver.PRELOAD = ("torch",)
server = forkserver.ForkServer()
script, out = sys.argv[1], sys.argv[2]
first = server.spawn([script, out + ".forked"], dict(os.environ))
first.wait()
forkserver.cuda_fork_poisoned = lambda: True  # what torch reports in a child forked after the driver was asked
server.close()
server = forkserver.ForkServer()
second = server.spawn([script, out + ".fresh"], dict(os.environ))
second.wait()
print(json.dumps({"codes": [first.returncode, second.returncode], "launcher": os.getpid()}))
server.close()
"""


def test_a_replica_forked_where_cuda_cannot_start_becomes_a_new_interpreter(tmp_path):
    """On a GPU, a replica forked after a parent asked the CUDA driver fails at its first CUDA call ("Cannot
    re-initialize CUDA in forked subprocess"): it execs a new interpreter instead, still the launcher's child."""
    script = tmp_path / "replica.py"
    script.write_text("import json, os, sys\nopen(sys.argv[1], 'w').write(json.dumps(['torch' in sys.modules, "
                      "os.getppid(), sys.argv]))\n")
    out = str(tmp_path / "seen")
    done = subprocess.run([sys.executable, "-c", POISONED, str(script), out], env=ENV, capture_output=True,
                          text=True, timeout=BOUND_S)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["codes"] == [0, 0], done.stderr[-3000:]
    forked, fresh = (json.loads(open(f"{out}.{k}").read()) for k in ("forked", "fresh"))
    assert forked == [True, seen["launcher"], [str(script), f"{out}.forked"]]  # torch came with the fork
    assert fresh == [False, seen["launcher"], [str(script), f"{out}.fresh"]]  # a new interpreter imported nothing


POOL = """
import json, os, sys, torch
from gradsync.tools.elastic import forkserver
torch.set_num_threads(torch.get_num_threads())  # this process used torch's thread pool: a fork leaves it corrupt
forkserver.PRELOAD = ("torch",)
server = forkserver.ForkServer()
replicas = [server.spawn([sys.argv[1]], dict(os.environ)) for _ in range(10)]
print(json.dumps([replica.wait() for replica in replicas]))
server.close()
"""
RACING = """
import sys, threading, torch
x, gate, failed = torch.ones(4_000_000), threading.Barrier(6), []
def first_parallel_op():  # each thread's first op that splits its work initializes that thread's pool use
    gate.wait()
    try:
        (x * 2).sum()
    except RuntimeError as exc:
        failed.append(exc)
threads = [threading.Thread(target=first_parallel_op) for _ in range(6)]
[t.start() for t in threads]
[t.join() for t in threads]
sys.exit(str(failed[0]) if failed else 0)
"""


def test_threads_of_a_forked_replica_find_torchs_thread_pool_in_place(tmp_path):
    """After a fork, the first use of torch's thread pool replaces the parent's, and a thread that uses it meanwhile
    finds none: "Invalid thread pool!" (a comm hook's callback on gloo's thread and the backward, now and then in
    the elastic drills beside two busy processes; 6 threads at once failed 28 plain forks of 30, and 2 to 4 of these
    10 replicas). The server makes that first use before the script runs."""
    script = tmp_path / "replica.py"
    script.write_text(RACING)
    done = subprocess.run([sys.executable, "-c", POOL, str(script)], env=ENV, capture_output=True, text=True,
                          timeout=BOUND_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == [0] * 10, done.stderr[-3000:]


@pytest.mark.parametrize("port", ["99999", "-5"])
def test_the_coordinators_port_out_of_range_is_refused(port, capsys):
    from gradsync.tools.elastic.coordinator import parse_args
    with pytest.raises(SystemExit) as exit_:  # was an OverflowError traceback from bind()
        parse_args(["--replicas", "2", "--port", port])
    assert exit_.value.code == 2 and "--port must be from 0" in capsys.readouterr().err


def test_a_missing_script_is_one_line_before_anything_starts(tmp_path):
    """It was a traceback through the fork server, once per restart."""
    proc = subprocess.run([sys.executable, "-m", "gradsync.tools.cli", "run", "--max-restarts", "2", "nosuch.py"],
                          env=ENV, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip().endswith("nosuch.py': no such script"), proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_replica_that_never_arrives_fails_the_job_at_once(tmp_path):
    """The others waited for it in generation 0 until the 60 s bound, then died of a raw store timeout."""
    body = """
    if rid == 1:
        sys.exit(1)  # before init_process_group, with no restarts left
    import gradsync
    gradsync.elastic.init_process_group("gloo")
    """
    start = time.monotonic()
    rc, _, err = finish(launch(tmp_path, ["--replicas", "2"], body))
    assert rc == 1, err
    assert "the job failed: replica 1 exited with code 1 before the job started, with no restarts left" in err, err
    assert "MembershipError: gradsync: the job failed before it started" in err, err
    assert time.monotonic() - start < 40


def test_an_unresolvable_coordinator_is_one_line_at_once(tmp_path):
    """It retried the name for over a minute, then raised a C++ traceback."""
    (tmp_path / "s.py").write_text("")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "gradsync.tools.cli", "run", "--coordinator", "nosuch.invalid:29400",
                           "s.py"], env=ENV, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "cannot resolve 'nosuch.invalid'" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and time.monotonic() - start < 30


def test_an_unknown_command_is_named(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bogus"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err  # it printed the usage alone, on stdout
    assert err.startswith("gradsync: unknown command 'bogus'") and "commands:" in err
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    assert exit_.value.code == 0 and "commands:" in capsys.readouterr().out


@pytest.mark.parametrize("options", [[], ["--fresh-interpreters"]], ids=["forked", "fresh"])
def test_replicas_end_with_a_launcher_that_is_sigkilled(tmp_path, options):
    """They ran on, orphaned (a GPU's memory with them)."""
    proc = launch(tmp_path, ["--replicas", "2", *options], """
    open(os.path.join(out, f"pid-{rid}"), "w").write(str(os.getpid()))
    time.sleep(600)
    """)
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("pid-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [int(p.read_text()) for p in tmp_path.glob("pid-*")]
        assert len(pids) == 2
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 20

        def running(pid):  # a zombie no one reaps has ended
            try:
                return open(f"/proc/{pid}/stat", "rb").read().rsplit(b")", 1)[1].split()[0] != b"Z"
            except FileNotFoundError:
                return False
        while any(map(running, pids)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(map(running, pids))
    finally:
        proc.kill()
        for p in tmp_path.glob("pid-*"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(p.read_text()), signal.SIGKILL)


def test_a_coordinator_address_where_no_store_answers_ends_within_the_bound(monkeypatch):
    """A program that accepts and never answers (not a store) held the launcher for good: the store client's
    handshake has no bound of its own."""
    from gradsync.tools.elastic import coordinator
    monkeypatch.setattr(coordinator, "CONNECT_S", 2.0)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        start = time.monotonic()
        with pytest.raises(SystemExit, match="nothing answered as a coordinator"):
            coordinator.bounded_connect(f"127.0.0.1:{listener.getsockname()[1]}")
        assert time.monotonic() - start < 30
