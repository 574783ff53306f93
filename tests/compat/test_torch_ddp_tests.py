"""torch's own DDP tests (distributed_test.py, gloo, 2 CPU ranks, GPU gates ported) on gradsync, both ways.

The suite is the tests torch's DDP passes on the CPU port, recorded in ``torch_ddp_tests.torch.json``
(``torch_ddp_tests.py all --save-baseline``; selection rules in that runner's docstring). This runs
it inside ``gradsync.replace_torch_ddp()`` and after the one-line class assignment, side by side
(~60-90 s on 2 shared cores; every test bounded by 60 s, each mode by 300 s), and holds gradsync to
every test of the suite in both modes except the strict, commented list
``torch_ddp_tests.EXPECTED_GRADSYNC_FAILURES``. With GRADSYNC_UPDATE_COMPAT_TABLE=1 it runs torch's
DDP too, and rewrites the baseline and ``tests/compat/torch_ddp_tests.md``.
"""
import json
import os

import pytest

pytest.importorskip("expecttest", reason="torch's distributed test utilities need expecttest: "
                                         "pip install torch==2.13.0 -e '.[compat]'")

import torch  # noqa: E402

import torch_ddp_tests as runner  # noqa: E402

pytestmark = pytest.mark.compat
TOTAL_TIMEOUT = 300  # per mode; about a minute expected
GRADSYNC_MODES = ["gradsync", "assign"]
UPDATE = os.environ.get("GRADSYNC_UPDATE_COMPAT_TABLE") == "1"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("torch-ddp-tests")
    if UPDATE:
        modes = runs_ = runner.run_modes(out, ["torch", *GRADSYNC_MODES], runner.DEFAULT_TIMEOUT, None,
                                         TOTAL_TIMEOUT, out / "torch_ddp_tests.torch.json")
        runner.save_baseline(runs_["torch"])
        torch_run = modes.pop("torch")
        runner.BASELINE.with_name("torch_ddp_tests.md").write_text(runner.table(torch_run, modes))
        return torch_run, modes
    torch_run = json.loads(runner.BASELINE.read_text())
    if torch_run["torch"].split("+")[0] != torch.__version__.split("+")[0]:
        pytest.skip(f"the recorded suite is torch {torch_run['torch']}'s; this is torch {torch.__version__}: "
                    "run with GRADSYNC_UPDATE_COMPAT_TABLE=1 to record it again")
    modes = runner.run_modes(out, GRADSYNC_MODES, runner.DEFAULT_TIMEOUT, None, TOTAL_TIMEOUT, runner.BASELINE)
    return torch_run, modes


def suite(torch_run):
    return sorted(n for n, r in torch_run["tests"].items() if r["result"] == "pass")


def test_the_ported_suite_is_torchs_ddp_tests_on_cpu(runs):
    torch_run, modes = runs
    names = suite(torch_run)
    # the CPU tests torch runs itself, and GPU-gated ones the port opened to CPU/gloo
    assert len(names) >= 45, names
    assert "test_accumulate_gradients_no_sync" in names and "test_DistributedDataParallelCPU" in names
    ported = [n for n in names if torch_run["tests"][n].get("ported")]
    assert len(ported) >= 30 and "test_skip_all_reduce_unused_parameters" in ported
    assert "test_ddp_logging_data_cpu" in torch_run["excluded_private_api"]  # private API: left out
    for mode, record in modes.items():
        assert set(record["tests"]) == set(names), f"{mode} runs exactly the suite"
    if UPDATE:
        failed = {n: r["reason"] for n, r in torch_run["tests"].items() if r["result"] == "fail"}
        print(f"not portable (torch's DDP fails them on CPU): {failed}")


@pytest.mark.parametrize("mode", GRADSYNC_MODES)
def test_gradsync_passes_the_suite_but_the_expected_failures(runs, mode):
    torch_run, modes = runs
    results = modes[mode]["tests"]
    expected = runner.EXPECTED_GRADSYNC_FAILURES
    text = "\n".join(f"{n}: {r['result']} {r['reason']}" for n, r in sorted(results.items()))
    unexpected = {n: r["reason"] for n, r in results.items() if r["result"] != "pass" and n not in expected}
    stale = [n for n in expected if n in results and results[n]["result"] == "pass"]
    gone = [n for n in expected if n not in results]
    other_reason = {n: results[n]["reason"] for n, (marker, _) in expected.items()
                    if n in results and results[n]["result"] != "pass" and marker not in results[n]["reason"]}
    assert not unexpected, f"torch DDP tests that gradsync fails ({mode}):\n{unexpected}\n\n{text}"
    assert not stale, f"now pass on gradsync ({mode}): remove them from EXPECTED_GRADSYNC_FAILURES: {stale}"
    assert not gone, f"no longer in the suite: remove from EXPECTED_GRADSYNC_FAILURES: {gone}"
    assert not other_reason, f"expected failures that now fail for another reason ({mode}): {other_reason}"
    passed = sum(r["result"] == "pass" for r in results.values())
    assert passed == len(suite(torch_run)) - len(expected), text
