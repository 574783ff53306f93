"""Run a script of tests/compat in its own process group: bounded in time, nothing left behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


@dataclass
class Finished:
    returncode: int | None
    timed_out: bool
    tail: str  # the last lines of the combined output
    leftovers: bool  # processes of the group were still alive after the main one ended (and were killed)
    log: Path  # stdout and stderr of the whole process group

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def environment(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")
    # nothing may be downloaded at run time
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    for ci_flag in ("CI", "PYTORCH_TEST_WITH_SLOW", "PYTORCH_TEST_SKIP_FAST", "IN_CI"):
        env.pop(ci_flag, None)  # torch's test utilities change behaviour on CI (retries, slow tests)
    env.update(extra)
    return env


def assert_identical(weights: dict, expected: dict, what: str) -> None:
    """Every tensor of ``weights`` equals ``expected``'s bit for bit."""
    import torch
    assert weights.keys() == expected.keys()
    for name, value in weights.items():
        assert torch.equal(value, expected[name]), (
            f"{what}: {name} differs by {(value - expected[name]).abs().max().item():.3g}")


def run_bounded(cmd: list[str], timeout: float, log: Path, **env: str) -> Finished:
    """Run ``cmd`` in a new session; on return every process of that session is gone."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=environment(**env),
                                start_new_session=True, cwd=str(SRC.parent))
        timed_out = False
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            leftovers = _kill_group(proc.pid)
            proc.wait()
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
    return Finished(None if timed_out else proc.returncode, timed_out, tail, leftovers, log)


def _kill_group(pgid: int) -> bool:
    """SIGKILL the process group we created (only ours: its id is our child's pid)."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


if __name__ == "__main__":  # pragma: no cover - manual use: python compat_proc.py TIMEOUT LOG CMD...
    result = run_bounded(sys.argv[3:], float(sys.argv[1]), Path(sys.argv[2]))
    print(result)
