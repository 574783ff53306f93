"""Elastic jobs without ``gradsync run``: a ``gradsync coordinator`` (or an etcd cluster) and replicas started by
torchrun or by hand.

- torchrun: a worker of one of two torchruns is SIGKILLed (or frozen by SIGSTOP) mid-run: that torchrun restarts
  its group, the other never restarts, and all four replicas finish bit-identical and equal (1e-5) to one process
  trained on exactly what was kept.
- admission: replicas of another job, claiming a running replica's place, or running another model are refused
  while the job goes on.
- SIGUSR1 stops every replica at the same window end; two busy processes cause no false eviction.
- etcd: the store's leader SIGKILLed mid-run costs no window; ``gradsync run`` works on it too.
- the Kubernetes manifest (not applied here) and the coordinator's own failures.
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from forked_cli import run_cli  # noqa: E402
from test_elastic import STEPS, SCRIPT, agreeing, check_run, reference, survivors  # noqa: E402

TIMEOUT = 240.0
GRADSYNC = [sys.executable, "-c", "from gradsync.tools.cli import main; main()"]


class Job:
    """A coordinator and the launchers started against it; every process is ended when the test ends."""

    def __init__(self, tmp_path: Path, replicas: int, min_replicas: int, etcd: str | None = None):
        self.tmp, self.procs = tmp_path, {}
        log = open(tmp_path / "coordinator.log", "w")
        where = ["--coordinator", etcd] if etcd else ["--port", "0"]
        self.coordinator = subprocess.Popen([*GRADSYNC, "coordinator", *where, "--replicas", str(replicas),
                                             "--min-replicas", str(min_replicas)], stdout=subprocess.PIPE,
                                            stderr=log, text=True, start_new_session=True)
        line = self.coordinator.stdout.readline()
        found = re.search(r"(listening on (\S+):(\d+)|etcd at \S+), job (\w+)", line)
        assert found, f"the coordinator said {line!r}"
        self.address, self.job_id = etcd or f"{found[2]}:{found[3]}", found[4]

    def env(self, group: str, **extra: str) -> dict[str, str]:
        return {**os.environ, "GRADSYNC_COORDINATOR": self.address, "GRADSYNC_GROUP": group, "OMP_NUM_THREADS": "1",
                **extra}

    def torchrun(self, group: str, *script_args: str) -> None:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "--max-restarts", "2", "--monitor-interval", "0.1", str(SCRIPT), "--out", str(self.tmp),
                "--steps", str(STEPS), *script_args]
        self.start(group, argv, self.env(group))

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        with open(self.tmp / f"{name}.log", "w") as log:
            self.procs[name] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                start_new_session=True)

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def wait(self, deadline: float) -> dict[str, int]:
        """Every launcher's and the coordinator's exit code; fails at once when a launcher fails."""
        procs = {**self.procs, "coordinator": self.coordinator}
        while any(p.poll() is None for p in procs.values()):
            failed = [n for n, p in self.procs.items() if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                why = f"{failed} failed" if failed else f"ran past {TIMEOUT:g}s"
                pytest.fail(f"{why};\n" + "\n".join(f"--- {n} ---\n{self.log(n)[-3000:]}" for n in self.procs))
            time.sleep(0.1)
        return {name: p.returncode for name, p in procs.items()}

    def wait_for_starts(self, n: int, deadline: float) -> None:
        """Until ``n`` replicas started (each writes a record once it is in the job)."""
        while len(list(self.tmp.glob("start-*"))) < n:
            assert time.monotonic() < deadline and all(p.poll() is None for p in self.procs.values()), \
                "\n".join(self.log(n)[-2000:] for n in self.procs)
            time.sleep(0.1)

    def close(self) -> None:
        for proc in [*self.procs.values(), self.coordinator]:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture
def job(tmp_path):
    jobs = []
    yield lambda replicas=4, min_replicas=2, etcd=None: jobs.append(Job(tmp_path, replicas, min_replicas, etcd)) or jobs[-1]
    for j in jobs:
        j.close()


def starts(tmp_path: Path) -> dict[str, int]:
    """Starts of each worker (GROUP:LOCAL_RANK), from the records every start writes."""
    counts: dict[str, int] = {}
    for f in tmp_path.glob("start-*"):
        where = f.name.split("-")[1]
        counts[where] = counts.get(where, 0) + 1
    return counts


def check_finished(tmp_path: Path, job: Job, codes: dict[str, int], adamw: bool = False) -> dict:
    assert codes == {"a": 0, "b": 0, "coordinator": 0}, job.log("a")[-3000:] + job.log("b")[-3000:]
    assert starts(tmp_path) == {"a:0": 2, "a:1": 2, "b:0": 1, "b:1": 1}  # torchrun a restarted its group once
    first = agreeing(survivors(tmp_path), [0, 1, 2, 3], job.log("a"))
    assert sorted(first["members"]) == [0, 1, 2, 3] and any(e["left"] for e in first["events"])
    want = reference(first["events"], 4, windows=first["windows"], adamw=adamw)
    for got, ref in zip(first["params"], want):
        assert (got - ref).abs().max() <= 1e-5
    return first


def test_torchrun_a_killed_worker_restarts_only_its_group(tmp_path, job):
    """Replica a:1 is SIGKILLed with a bucket in flight; torchrun a restarts both its workers, which the members
    admit together (every replica must then record the same event)."""
    j = job()
    deadline = time.monotonic() + TIMEOUT
    for group in "ab":
        j.torchrun(group, "--victim", "a:1", "--window", "1", "--point", "during_reductions", "--sleep", "0.05",
                   "--until-full", "4", "--admit-together", "2")  # the restarted group is admitted at once
    check_finished(tmp_path, j, j.wait(deadline))


@pytest.mark.slow  # a 5 s heartbeat timeout, then a restart: about 25 s each
@pytest.mark.parametrize("point, sharded", [("freeze", False), ("freeze_during_reductions", False),
                                           ("freeze_during_reductions", True), ("freeze_in_step", True)])
def test_torchrun_a_frozen_worker_is_left_out_and_its_group_restarts(tmp_path, job, point, sharded):
    """Replica a:1 stops (SIGSTOP, its heartbeat with it) before its forward, inside its synced backward after its
    header and first bucket (also sharded, with AdamW), or, sharded, between its step's all-gathers; the others leave
    it out once its beat stood still for 5 s and go on; when it is continued it finds itself left out and exits
    (what it sends in the old group changes nothing of the others'), and torchrun restarts its group."""
    j = job()
    deadline = time.monotonic() + TIMEOUT
    for group in "ab":
        j.torchrun(group, "--victim", "a:1", "--window", "1", "--point", point, "--sleep", "0.05",
                   "--until-full", "4", *(["--sharded"] if sharded else []))
    while "left in window" not in j.log("b"):
        assert time.monotonic() < deadline and all(p.poll() is None for p in j.procs.values()), j.log("b")[-3000:]
        time.sleep(0.1)
    os.kill(int((tmp_path / "frozen.pid").read_text()), signal.SIGCONT)
    check_finished(tmp_path, j, j.wait(deadline), adamw=sharded)
    # the memory a frozen member could still write into is never used again: each generation has its own
    changed = 0
    for replica, result in survivors(tmp_path).items():
        by_generation = {}
        for generation, pointers in result["memory"]:
            by_generation.setdefault(generation, set()).update(pointers)
        ordered = [by_generation[g] for g in sorted(by_generation)]
        changed += max(len(ordered) - 1, 0)
        assert all(not (a & b) for a, b in zip(ordered, ordered[1:])), (replica, result["memory"])
    assert changed, "no replica trained in two generations"


def test_admission_refuses_another_job_a_twin_and_another_model(tmp_path, job):
    """Two replicas without a launcher run the job; a replica carrying another job id, a second process
    claiming replica a:0, and a replica whose model is one layer wider are each refused with an error
    that says why, and the job finishes as if they never came."""
    j = job(replicas=2, min_replicas=1)
    deadline = time.monotonic() + TIMEOUT
    train = [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--steps", str(STEPS), "--sleep", "0.02"]
    for local in "01":
        j.start(f"a{local}", [*train, "--until-refused", "1"], j.env("a", LOCAL_RANK=local))
    j.wait_for_starts(2, deadline)  # both are in the job: the twin arrives second
    cases = {"other_job": ([], j.env("x", GRADSYNC_JOB_ID="another-job")),
             "twin": ([], j.env("a", LOCAL_RANK="0")),
             "wider": (["--width", "17"], j.env("w"))}
    for name, (extra, env) in cases.items():
        j.start(name, [*train, *extra], env)
        code = j.procs.pop(name).wait(max(deadline - time.monotonic(), 1))
        assert code == 1, j.log(name)[-3000:]
    assert f"belongs to job 'another-job' (GRADSYNC_JOB_ID), but the coordinator at {j.address} runs job " \
           f"'{j.job_id}'" in j.log("other_job")
    assert re.search(r"replica [01] \(GRADSYNC_GROUP='a', LOCAL_RANK=0\) is already running", j.log("twin"))
    wider = j.log("wider")
    assert "replica 2 was refused at admission: its model or options differ from the members'" in wider, wider[-3000:]
    assert "parameter '0.weight': (17, 8) torch.float32" in wider and "(16, 8) torch.float32" in wider
    codes = j.wait(deadline)
    assert codes == {"a0": 0, "a1": 0, "coordinator": 0}
    first = agreeing(survivors(tmp_path), [0, 1], j.log("a0"))
    assert first["events"] == []
    want = reference([], 2, windows=first["windows"])
    for got, ref in zip(first["params"], want):
        assert (got - ref).abs().max() <= 1e-5


@pytest.mark.slow  # 20 s of windows beside two busy processes
def test_no_false_eviction_beside_two_cpu_bound_processes(tmp_path, job):
    """Two replicas without a launcher train for 20 s (four heartbeat timeouts) while two processes spin on
    this machine's cores: no replica is taken for gone."""
    j = job(replicas=2, min_replicas=1)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        deadline = time.monotonic() + TIMEOUT
        for local in "01":
            j.start(f"a{local}", [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--steps", str(STEPS),
                                  "--windows", "200", "--sleep", "0.1"], j.env("a", LOCAL_RANK=local))
        codes = j.wait(deadline)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    assert codes == {"a0": 0, "a1": 0, "coordinator": 0}, j.log("a0")[-3000:]
    first = agreeing(survivors(tmp_path), [0, 1], j.log("a0"))
    assert first["events"] == [] and first["windows"] == 200


def test_kubernetes_manifest_runs_the_coordinator_and_sets_what_replicas_read():
    """The manifest is not applied here (no cluster); its commands and environment are the ones gradsync reads."""
    yaml = pytest.importorskip("yaml")
    from gradsync.tools.elastic.coordinator import parse_args
    docs = {(d["kind"], d["metadata"]["name"]): d for d in
            yaml.safe_load_all((Path(__file__).parents[2] / "examples/launchers/kubernetes.yaml").read_text())}
    coordinator = docs["Job", "gradsync-coordinator"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert coordinator[:2] == ["gradsync", "coordinator"]
    args = parse_args(coordinator[2:])
    assert docs["Service", "gradsync-coordinator"]["spec"]["ports"][0]["targetPort"] == args.port
    replicas = docs["Job", "gradsync-replicas"]["spec"]
    assert replicas["completionMode"] == "Indexed" and replicas["completions"] == args.replicas
    pod = replicas["template"]["spec"]
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert pod["restartPolicy"] == "OnFailure" and set(env) == {"GRADSYNC_COORDINATOR", "GRADSYNC_JOB_ID",
                                                                 "GRADSYNC_GROUP", "LOCAL_RANK"}
    assert env["GRADSYNC_COORDINATOR"]["value"] == f"gradsync-coordinator:{args.port}"
    assert env["GRADSYNC_JOB_ID"]["value"] == args.job_id


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def etcd_status(client: int) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{client}/v3/maintenance/status", data=b"{}", method="POST")
    with urllib.request.urlopen(request, timeout=1) as answer:
        return json.loads(answer.read())


@pytest.fixture
def etcd_cluster(tmp_path):
    """Three etcd members on loopback ports; yields {client port: process}."""
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed here (Debian: apt-get install etcd-server)")
    ports = free_ports(6)
    clients, peers = ports[:3], ports[3:]
    cluster = ",".join(f"m{i}=http://127.0.0.1:{p}" for i, p in enumerate(peers))
    members = {}
    for i, (client, peer) in enumerate(zip(clients, peers)):
        members[client] = subprocess.Popen(
            ["etcd", "--name", f"m{i}", "--data-dir", str(tmp_path / f"etcd{i}"),
             "--listen-client-urls", f"http://127.0.0.1:{client}", "--advertise-client-urls", f"http://127.0.0.1:{client}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", cluster, "--initial-cluster-state", "new", "--initial-cluster-token", tmp_path.name],
            stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"etcd{i}.log", "w"))
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if all(etcd_status(c).get("leader") for c in clients):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "etcd0.log").read_text()[-3000:]
            time.sleep(0.1)
        yield members
    finally:
        for proc in members.values():
            proc.kill()
            proc.wait()


def test_etcd_coordinator_survives_its_leader_killed_without_losing_a_window(tmp_path, job, etcd_cluster):
    """The job's store on three etcd members; its leader is SIGKILLed mid-run: the replicas fail over to the
    other two (a new leader is elected), and the job finishes with no membership change and no window lost."""
    address = "etcd://" + ",".join(f"127.0.0.1:{c}" for c in etcd_cluster) + "/drill"
    j = job(replicas=2, min_replicas=1, etcd=address)
    deadline = time.monotonic() + TIMEOUT
    for local in "01":
        j.start(f"a{local}", [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--steps", str(STEPS),
                              "--windows", "50", "--sleep", "0.05"], j.env("a", LOCAL_RANK=local))
    j.wait_for_starts(2, deadline)
    time.sleep(1.0)  # some windows in
    status = etcd_status(next(iter(etcd_cluster)))
    leader = next(c for c in etcd_cluster if etcd_status(c)["header"]["member_id"] == status["leader"])
    assert all(p.poll() is None for p in j.procs.values()), "the job ended before the leader was killed"
    etcd_cluster[leader].kill()
    codes = j.wait(deadline)
    assert codes == {"a0": 0, "a1": 0, "coordinator": 0}, j.log("a0")[-3000:]
    first = agreeing(survivors(tmp_path), [0, 1], j.log("a0"))
    assert first["events"] == [] and first["windows"] == 50
    assert etcd_cluster[leader].poll() is not None  # it was dead before the job ended
    want = reference([], 2, windows=50)
    for got, ref in zip(first["params"], want):
        assert (got - ref).abs().max() <= 1e-5


def start_pair(j: Job, tmp_path: Path, *extra: str) -> None:
    """Start two replicas of launcher group "a" that train until stopped; return once both run."""
    deadline = time.monotonic() + TIMEOUT
    for local in "01":
        j.start(f"a{local}", [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--steps", str(STEPS),
                              "--windows", "100000", "--sleep", "0.02", *extra], j.env("a", LOCAL_RANK=local))
    j.wait_for_starts(2, deadline)
    time.sleep(1.0)


def test_a_replica_cut_off_from_its_peer_and_the_coordinator_ends_within_one_timeout(tmp_path, job):
    """Its peer frozen first (a collective waits in slices, asking the coordinator between them), then the coordinator:
    the store's timeout in that question became a peer failure, whose re-form asked the coordinator again and waited a
    second timeout (20 s for 10) before the replica ended, saying it had waited 10."""
    j = job(replicas=2, min_replicas=1)
    start_pair(j, tmp_path, "--timeout", "10")
    os.kill(j.procs["a1"].pid, signal.SIGSTOP)
    time.sleep(1.0)  # a0 waits in its collective's slices
    os.kill(j.coordinator.pid, signal.SIGSTOP)
    frozen = time.monotonic()
    a0 = j.procs["a0"]
    while a0.poll() is None and time.monotonic() - frozen < 90:
        time.sleep(0.1)
    took = time.monotonic() - frozen
    for name in ("a1", "coordinator"):
        os.kill((j.procs[name] if name != "coordinator" else j.coordinator).pid, signal.SIGCONT)
    assert a0.poll() not in (None, 0), j.log("a0")[-3000:]
    print(f"a0 ended {took:.1f} s after the coordinator froze")
    assert took < 18, f"a0 took {took:.1f} s to end with a 10 s timeout\n" + j.log("a0")[-3000:]
    assert f"the coordinator at {j.address} did not answer within 10s" in j.log("a0"), j.log("a0")[-3000:]


def test_sigusr1_stops_every_replica_at_the_same_window_end(tmp_path, job):
    """SLURM's warning before the time limit: one replica receives SIGUSR1 mid-run; every replica finishes the
    window, stops at the same boundary (gradsync.elastic.stopping), saves and exits 0, and so does the coordinator."""
    j = job(replicas=2, min_replicas=1)
    deadline = time.monotonic() + TIMEOUT
    for local in "01":
        j.start(f"a{local}", [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--steps", str(STEPS),
                              "--windows", "100000", "--sleep", "0.02"], j.env("a", LOCAL_RANK=local))
    j.wait_for_starts(2, deadline)
    time.sleep(1.0)
    j.procs["a1"].send_signal(signal.SIGUSR1)
    codes = j.wait(deadline)
    assert codes == {"a0": 0, "a1": 0, "coordinator": 0}, j.log("a0")[-3000:]
    first = agreeing(survivors(tmp_path), [0, 1], j.log("a0"))
    assert first["events"] == [] and 0 < first["windows"] < 100000
    want = reference([], 2, windows=first["windows"])
    for got, ref in zip(first["params"], want):
        assert (got - ref).abs().max() <= 1e-5


def test_gradsync_run_on_etcd_survives_a_kill(tmp_path, etcd_cluster):
    """``gradsync run --coordinator etcd://...``: no launcher hosts the store; a replica SIGKILLed with a bucket in
    flight costs the survivors only its window, as on the launcher's own store."""
    address = "etcd://" + ",".join(f"127.0.0.1:{c}" for c in etcd_cluster) + "/run"
    proc = run_cli(["run", "--replicas", "3", "--min-replicas", "2", "--coordinator", address, str(SCRIPT), "--out",
                    str(tmp_path), "--windows", "4", "--steps", str(STEPS), "--victim", "2", "--window", "1",
                    "--point", "during_reductions"], timeout=TIMEOUT)
    check_run(tmp_path, proc, victim=2, window=1)


def test_coordinator_ends_on_sigterm_and_says_what_it_cannot_use(tmp_path):
    j = Job(tmp_path, replicas=2, min_replicas=1)
    try:
        port = j.address.rpartition(":")[2]
        taken = subprocess.run([*GRADSYNC, "coordinator", "--port", port, "--replicas", "2"],
                               capture_output=True, text=True, timeout=60)
        j.coordinator.send_signal(signal.SIGTERM)
        assert j.coordinator.wait(30) == 128 + signal.SIGTERM
    finally:
        j.close()
    bad = subprocess.run([*GRADSYNC, "coordinator", "--coordinator", "h1:2379", "--replicas", "2"],
                         capture_output=True, text=True, timeout=60)
    assert taken.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in taken.stderr, taken.stderr
    assert bad.returncode == 2 and "--coordinator must be etcd://HOST:PORT" in bad.stderr, bad.stderr


def test_a_frozen_coordinator_ends_every_replica_within_its_timeout(tmp_path, job):
    """The coordinator SIGSTOPped mid-run (as a hung machine, or a network cut without a reset): TCPStore's own timeout
    bounds only its waits for keys, so the replicas' next votes waited for good. Each replica now ends within about
    its timeout (5 s here), non-zero, saying which coordinator did not answer."""
    j = job(replicas=2, min_replicas=1)
    start_pair(j, tmp_path, "--timeout", "5")
    os.kill(j.coordinator.pid, signal.SIGSTOP)
    frozen = time.monotonic()
    while any(p.poll() is None for p in j.procs.values()) and time.monotonic() - frozen < 90:
        time.sleep(0.1)
    took = time.monotonic() - frozen
    codes = {name: p.poll() for name, p in j.procs.items()}
    assert all(code not in (None, 0) for code in codes.values()), (codes, j.log("a0")[-3000:])
    assert took < 60, f"the replicas took {took:.0f} s to end"
    for name in j.procs:
        assert f"the coordinator at {j.address} did not answer within 5s" in j.log(name), j.log(name)[-3000:]
