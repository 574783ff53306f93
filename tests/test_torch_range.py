"""`import gradsync` warns when torch is outside the tested range, and only then."""
import warnings

import pytest
import torch

import gradsync
from gradsync import _torch_range as tr


@pytest.mark.parametrize("version", ["2.13.0", "2.13.0+cpu", "2.14.1", "2.14.1+cu130", "2.14.0a0+git1234",
                                     "2.14.7"])
def test_inside_the_range_no_warning(version):
    assert tr.untested_message(version) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tr.warn_if_untested(version) is False


@pytest.mark.parametrize("version", ["2.12.1", "2.4.0", "2.15.0", "2.15.0.dev20261201+cpu", "3.0.0", "1.13.1",
                                     "garbage"])
def test_outside_the_range_warns_with_version_and_range(version):
    with pytest.warns(gradsync.UntestedTorchWarning) as caught:
        assert tr.warn_if_untested(version) is True
    message = str(caught[0].message)
    assert f"this is torch {version}" in message and "tested with torch 2.13 to 2.14.x" in message
    assert "may still work" in message


def test_release_reads_major_and_minor():
    assert tr.release("2.14.1+cu130") == (2, 14)
    assert tr.release("2.10.0") == (2, 10)  # numeric, not string, comparison: 2.10 < 2.13
    assert tr.release("nightly") is None


def test_the_running_torch_is_checked():
    expected = tr.untested_message(torch.__version__) is not None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert tr.warn_if_untested() is expected
    assert len([w for w in caught if issubclass(w.category, tr.UntestedTorchWarning)]) == int(expected)


def test_the_floor_in_pyproject_is_the_tested_minimum():
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    low = ".".join(map(str, tr.TESTED_MIN))
    assert f'"torch>={low}"' in text


def test_import_gradsync_warns_on_an_untested_torch():
    """The check runs at import (a subprocess: this one has gradsync imported already)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    probe = ("import warnings, torch; torch.__version__ = '2.99.0'\n"
             "with warnings.catch_warnings(record=True) as caught:\n"
             "    warnings.simplefilter('always'); import gradsync\n"
             "print([type(w.message).__name__ for w in caught], [str(w.message) for w in caught])")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         timeout=120, env=env).stdout
    assert "UntestedTorchWarning" in out and "this is torch 2.99.0" in out, out
