"""torch's own DDP tests (distributed_test.py, gloo, 2 CPU ranks) with torch's DDP and with gradsync.

Runs ``torch_ddp_tests.py`` twice (~25 s with torch, ~8 s with gradsync on the tests that ran;
every test bounded by 60 s), writes the comparison table next to the results (and into
``tests/compat/torch_ddp_tests.md`` when GRADSYNC_UPDATE_COMPAT_TABLE=1), and holds gradsync to
every test torch passes except the strict, commented list ``torch_ddp_tests.EXPECTED_GRADSYNC_FAILURES``.
"""
import os
from pathlib import Path

import pytest

pytest.importorskip("expecttest", reason="torch's distributed test utilities need expecttest: "
                                         "pip install torch==2.13.0 -e '.[compat]'")

import torch_ddp_tests as runner  # noqa: E402

pytestmark = pytest.mark.compat
TOTAL_TIMEOUT = 600  # per mode; well under a minute expected


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("torch-ddp-tests")
    torch_run, gradsync_run = runner.run_both(out, runner.DEFAULT_TIMEOUT, None, TOTAL_TIMEOUT)
    text = runner.table(torch_run, gradsync_run)
    (out / "torch_ddp_tests.md").write_text(text)
    if os.environ.get("GRADSYNC_UPDATE_COMPAT_TABLE") == "1":
        Path(runner.__file__).with_name("torch_ddp_tests.md").write_text(text)
    return torch_run, gradsync_run, text


def test_the_ddp_tests_run_on_cpu(runs):
    torch_run, gradsync_run, text = runs
    ran = [n for n, r in torch_run["tests"].items() if r["result"] != "skip"]
    # the no_sync, comm-hook, create_graph, grad-as-view and CPU DDP tests run on CPU/gloo
    assert len(ran) >= 10, text
    assert "test_accumulate_gradients_no_sync" in ran and "test_DistributedDataParallelCPU" in ran
    assert set(ran) == set(gradsync_run["tests"]), "gradsync runs exactly the tests that run on torch"
    failed = {n: r["reason"] for n, r in torch_run["tests"].items() if r["result"] == "fail"}
    assert not failed, f"torch's own DDP fails its tests here (environment problem?): {failed}"


def test_gradsync_passes_what_torch_passes(runs):
    torch_run, gradsync_run, text = runs
    passed_on_torch = [n for n, r in torch_run["tests"].items() if r["result"] == "pass"]
    results = {n: gradsync_run["tests"][n] for n in passed_on_torch}
    expected = runner.EXPECTED_GRADSYNC_FAILURES
    unexpected = {n: r["reason"] for n, r in results.items() if r["result"] != "pass" and n not in expected}
    stale = [n for n in expected if n in results and results[n]["result"] == "pass"]
    gone = [n for n in expected if n not in results]
    other_reason = {n: results[n]["reason"] for n, (marker, _) in expected.items()
                    if n in results and results[n]["result"] != "pass" and marker not in results[n]["reason"]}
    assert not unexpected, f"torch DDP tests that gradsync fails:\n{unexpected}\n\n{text}"
    assert not stale, f"now pass on gradsync: remove them from EXPECTED_GRADSYNC_FAILURES: {stale}"
    assert not gone, f"no longer run (or no longer pass on torch): remove from EXPECTED_GRADSYNC_FAILURES: {gone}"
    assert not other_reason, f"expected failures that now fail for another reason: {other_reason}"
