"""The SLURM recipe (examples/launchers/slurm.sbatch) on a real one-node SLURM: munged, slurmctld and slurmd
started here from a generated configuration and stopped after. Skipped where SLURM is not installed
(Debian: apt-get install slurmctld slurmd slurm-client munge)."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_elastic import SCRIPT, STEPS, agreeing, reference, survivors  # noqa: E402

DAEMONS = ["munged", "slurmctld", "slurmd", "sbatch", "squeue"]
MISSING = [d for d in DAEMONS if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"SLURM is not installed here (no {', '.join(MISSING)})")
RECIPE = Path(__file__).parents[2] / "examples" / "launchers" / "slurm.sbatch"
TIMEOUT = 240.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


@pytest.fixture
def slurm(tmp_path):
    """A one-node cluster; yields the environment its clients need."""
    d = tmp_path / "slurm"
    for sub in ("run", "state", "spool", "log"):
        (d / sub).mkdir(parents=True)
    (d / "munge.key").write_bytes(os.urandom(128))
    (d / "munge.key").chmod(0o600)
    node, cpus = socket.gethostname(), os.cpu_count()
    conf = d / "slurm.conf"
    conf.write_text(f"""ClusterName=gradsync
SlurmctldHost={node}
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
AuthInfo=socket={d}/run/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmdPidFile={d}/run/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
AccountingStorageType=accounting_storage/none
NodeName={node} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
""")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    started = []
    try:
        subprocess.run([binary("munged"), f"--key-file={d}/munge.key", f"--socket={d}/run/munge.sock",
                        f"--pid-file={d}/run/munged.pid", f"--log-file={d}/log/munged.log",
                        f"--seed-file={d}/run/munge.seed", "--force"], check=True, env=env, timeout=30)
        started.append(d / "run" / "munged.pid")
        for daemon in ("slurmctld", "slurmd"):
            subprocess.run([binary(daemon), "-f", str(conf)], check=True, env=env, timeout=30)
            started.append(d / "run" / f"{daemon}.pid")
        deadline = time.monotonic() + 30
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True).stdout:
            assert time.monotonic() < deadline, (d / "log" / "slurmctld.log").read_text()[-3000:]
            time.sleep(0.2)
        yield env
    finally:
        for pid_file in reversed(started):
            if pid_file.exists():
                try:
                    os.kill(int(pid_file.read_text()), signal.SIGTERM)
                except (ProcessLookupError, ValueError):
                    pass


def finished(job_id: str, env: dict, log: Path, deadline: float) -> str:
    """Wait until the job left the queue; its output."""
    while subprocess.run(["squeue", "-h", "-j", job_id], env=env, capture_output=True, text=True).stdout.strip():
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], env=env)
            pytest.fail(f"the job ran past {TIMEOUT:g}s:\n{log.read_text()[-4000:]}")
        time.sleep(0.5)
    return log.read_text()


def test_slurm_recipe_restarts_only_the_dead_replica(tmp_path, slurm):
    """sbatch the recipe with 3 tasks; replica task 1 SIGKILLs itself in window 1; its task's loop
    restarts it and it joins; the coordinator (the batch step) exits 0 once the script returned."""
    out = tmp_path / "out"
    out.mkdir()
    victim = f"{socket.gethostname()}:1"
    env = {**slurm, "PYTHON": sys.executable, "GRADSYNC_HOST": "127.0.0.1", "GRADSYNC_PORT": str(free_port()),
           "MIN_REPLICAS": "2", "MAX_RESTARTS": "1", "OMP_NUM_THREADS": "1"}
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--ntasks=3", "--overcommit", f"--output={tmp_path}/job.log", str(RECIPE), str(SCRIPT),
         "--out", str(out), "--steps", str(STEPS), "--victim", victim, "--window", "1", "--point", "during_reductions",
         "--sleep", "0.05", "--until-full", "3"], env=env, capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + TIMEOUT
    log = finished(job_id, env, tmp_path / "job.log", deadline)
    assert f"job {job_id} finished" in log, log[-4000:]
    assert log.count("exited with 137 (attempt 0)") == 1, log[-4000:]  # the victim, restarted once
    first = agreeing(survivors(out), [0, 1, 2], log)
    assert [e["left"] for e in first["events"] if e["left"]] and [e["joined"] for e in first["events"] if e["joined"]]
    want = reference(first["events"], 3, windows=first["windows"])
    for got, ref in zip(first["params"], want):
        assert (got - ref).abs().max() <= 1e-5


def test_slurm_signal_before_the_time_limit_stops_the_job_at_a_window_end(tmp_path, slurm):
    """scancel --signal=USR1 (what --signal=USR1@120 sends before the time limit) mid-run: every replica stops
    at the same window boundary, saves, and the job ends 0 with every task's loop ending (no restart)."""
    out = tmp_path / "out"
    out.mkdir()
    env = {**slurm, "PYTHON": sys.executable, "GRADSYNC_HOST": "127.0.0.1", "GRADSYNC_PORT": str(free_port()),
           "MIN_REPLICAS": "1", "MAX_RESTARTS": "1", "OMP_NUM_THREADS": "1"}
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--ntasks=2", "--overcommit", f"--output={tmp_path}/job.log", str(RECIPE), str(SCRIPT),
         "--out", str(out), "--steps", str(STEPS), "--windows", "100000", "--sleep", "0.02"],
        env=env, capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + TIMEOUT
    while len(list(out.glob("start-*"))) < 2:
        assert time.monotonic() < deadline, (tmp_path / "job.log").read_text()[-3000:]
        time.sleep(0.2)
    time.sleep(1.0)
    subprocess.run(["scancel", "--signal=USR1", job_id], env=env, check=True, timeout=30)
    log = finished(job_id, env, tmp_path / "job.log", deadline)
    assert f"job {job_id} finished" in log and "exited with" not in log, log[-4000:]
    first = agreeing(survivors(out), [0, 1], log)
    assert first["events"] == [] and 0 < first["windows"] < 100000
    want = reference([], 2, windows=first["windows"])
    for got, ref in zip(first["params"], want):
        assert (got - ref).abs().max() <= 1e-5
