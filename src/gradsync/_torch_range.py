"""The torch releases gradsync's test suite has passed on, and a warning at import outside them.

gradsync drives torch's autograd engine and process groups partly through private APIs
(_torch.py), which can change in any minor release; the range below is what was proven (the
whole suite, benchmarks/results/torch-*-suite.md), not a guess. pyproject.toml's floor is
TESTED_MIN; there is no ceiling there, so a newer torch installs and gets this warning instead.
"""
from __future__ import annotations

import re
import warnings

# Inclusive, as (major, minor): every patch release of these minors counts as tested.
TESTED_MIN = (2, 13)
TESTED_MAX = (2, 14)


class UntestedTorchWarning(UserWarning):
    """The running torch is outside the range gradsync was tested on. Silence it with
    ``warnings.filterwarnings("ignore", category=gradsync.UntestedTorchWarning)``."""


def release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a torch version string: ``"2.14.1+cu130"`` -> (2, 14); None if unreadable."""
    match = re.match(r"\s*v?(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def untested_message(version: str) -> str | None:
    """The warning's text when ``version`` is outside the tested range, else None."""
    found = release(version)
    if found is not None and TESTED_MIN <= found <= TESTED_MAX:
        return None
    low, high = (".".join(map(str, v)) for v in (TESTED_MIN, TESTED_MAX))
    return (f"gradsync was tested with torch {low} to {high}.x; this is torch {version}. It may still "
            f"work, but it is untested: gradsync uses private torch APIs (gradsync/_torch.py) that "
            f"can change between releases. Run gradsync's test suite on this torch to check.")


def warn_if_untested(version: str | None = None) -> bool:
    """Warn (UntestedTorchWarning) when the running torch, or ``version``, is outside the tested
    range; return whether it warned."""
    if version is None:
        import torch
        version = str(torch.__version__)
    message = untested_message(version)
    if message is not None:
        warnings.warn(message, UntestedTorchWarning, stacklevel=2)
    return message is not None
