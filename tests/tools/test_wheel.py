"""The distribution: `python -m build` gives an sdist and a pure wheel that `twine check` accepts, and
the wheel, installed into a fresh venv, trains from there (not from this checkout's src/).

The build runs on a copy of the checkout, so it leaves no build/ or egg-info here, and with
--no-isolation: the isolated build env would download setuptools. The fresh venv has no
system site-packages; torch is not reinstalled (a multi-GB download, or minutes unpacking), but this
venv's installs of the wheel's declared dependencies (torch, numpy) and of what they require are
linked into a folder that the fresh venv's .pth puts on its path: nothing else (pytest, matplotlib,
this checkout) is importable there, so an undeclared dependency fails the demo.
"""
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

import gradsync

ROOT = Path(__file__).resolve().parents[2]
SKIP = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", "demo-output",
                              ".pytest_cache")
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def run(cmd, **kw):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300, env=CLEAN_ENV, **kw)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def dist_dir(tmp_path_factory):
    pytest.importorskip("build")
    src = tmp_path_factory.mktemp("checkout") / "gradsync"
    shutil.copytree(ROOT, src, ignore=SKIP)
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "build", "--no-isolation", "--outdir", out, src])
    return out


def only(folder: Path, pattern: str) -> Path:
    found = list(folder.glob(pattern))
    assert len(found) == 1, found
    return found[0]


def package_modules() -> set[str]:
    pkg = Path(gradsync.__file__).parent
    return {p.relative_to(pkg.parent).as_posix() for p in pkg.rglob("*.py")}


def test_sdist_has_the_package_and_readme_not_the_suite(dist_dir):
    sdist = only(dist_dir, f"gradsync-{gradsync.__version__}.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {"README.md", "pyproject.toml", "PKG-INFO"} <= names
    assert {f"src/{m}" for m in package_modules()} <= names
    licenses = {p.name for p in ROOT.glob("LICEN[CS]E*")}
    assert licenses <= names
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "examples/", ".venv"))
                or "__pycache__" in n]


def test_wheel_is_pure_and_holds_only_the_package(dist_dir):
    wheel = only(dist_dir, f"gradsync-{gradsync.__version__}-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        meta = zf.read(f"gradsync-{gradsync.__version__}.dist-info/METADATA").decode()
        entry = zf.read(f"gradsync-{gradsync.__version__}.dist-info/entry_points.txt").decode()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"gradsync", f"gradsync-{gradsync.__version__}.dist-info"}, tops
    assert package_modules() <= names
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    assert "Root-Is-Purelib: true" in zf_text(wheel, "WHEEL")
    floor = re.search(r"^Requires-Dist: torch>=([0-9.]+)$", meta, re.M)
    assert floor, meta[:2000]
    for extra in ("dev", "accelerate", "lightning"):
        assert f"Provides-Extra: {extra}" in meta
    assert "gradsync = gradsync.tools.cli:main" in entry


def zf_text(wheel: Path, name: str) -> str:
    with zipfile.ZipFile(wheel) as zf:
        return zf.read(f"gradsync-{gradsync.__version__}.dist-info/{name}").decode()


def test_twine_accepts_both(dist_dir):
    pytest.importorskip("twine")
    out = run([sys.executable, "-m", "twine", "check", "--strict", *sorted(dist_dir.iterdir())])
    assert out.count("PASSED") == 2, out


def requirements(requires: list[str]) -> list[str]:
    """Project names of Requires-Dist entries, extras left out."""
    return [re.match(r"[A-Za-z0-9._-]+", r).group(0) for r in requires if "extra ==" not in r]


def requirement_closure(names: list[str]) -> list[metadata.Distribution]:
    """The installed distributions of ``names`` and of their requirements, recursively (a requirement
    whose marker excludes this platform is simply not installed)."""
    seen, todo, found = set(), list(names), []
    while todo:
        key = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(key)
        except metadata.PackageNotFoundError:
            continue
        found.append(dist)
        todo += requirements(dist.requires or [])
    return found


def link_installed(names: list[str], into: Path) -> None:
    """Symlink this venv's installs of ``names`` and their requirements (code and metadata) into ``into``."""
    into.mkdir()
    for dist in requirement_closure(names):
        base = Path(dist.locate_file(""))
        for top in {f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] not in ("..", "__pycache__")}:
            if (base / top).exists() and not top.endswith(".pth") and not (into / top).exists():
                (into / top).symlink_to(base / top)


def test_the_wheel_trains_from_a_fresh_venv(dist_dir, tmp_path):
    wheel = only(dist_dir, "*.whl")
    fresh = tmp_path / "fresh"
    run([sys.executable, "-m", "venv", "--without-pip", fresh])  # pip comes from here: --python below
    py, bin_dir = fresh / "bin" / "python", fresh / "bin"
    site = Path(run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    assert site.is_relative_to(fresh) and site != Path(sysconfig.get_paths()["purelib"])
    declared = requirements(re.findall(r"^Requires-Dist: (.*)$", zf_text(wheel, "METADATA"), re.M))
    assert "torch" in declared
    link_installed(declared, tmp_path / "deps")
    (site / "reuse_deps.pth").write_text(f"{tmp_path / 'deps'}\n")
    run([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", "--quiet", wheel])

    elsewhere = tmp_path / "elsewhere"  # cwd outside the source tree: nothing importable by accident
    elsewhere.mkdir()
    where = run([py, "-c", "import gradsync, torch; print(gradsync.__file__); print(torch.__version__)"],
                cwd=elsewhere).split()
    assert Path(where[0]).is_relative_to(site), where
    assert not Path(where[0]).resolve().is_relative_to(ROOT), where

    out = run([bin_dir / "gradsync", "demo", "--epochs", "2", "--samples", "512", "--batch", "32", "--accum", "4",
               "--out", elsewhere / "demo"], cwd=elsewhere)
    assert "8 of 32 backward passes reduced gradients" in out and "equivalence check passed" in out, out
