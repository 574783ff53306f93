"""The package's architecture, checked: imports point one way, walls around private names, small modules.

Tiers, lowest first: the base (``_torch``, ``_torch_range``, ``process``, ``tree``), the ``engine``,
torch's face and the hook catalogue (``ddp``, ``hooks``), the features (``accumulate``, ``sharded``,
``elastic``, ``chunked``, ``overlap``), the framework adapters (``lightning``), the ``tools``. A module
imports only its own tier and the ones below it; ``import gradsync`` loads no tool.
"""
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import gradsync

PACKAGE = Path(gradsync.__file__).parent
TIERS = [{"_torch", "_torch_range", "process", "tree"}, {"engine"}, {"ddp", "hooks", "deterministic"},
         {"accumulate", "sharded", "elastic", "chunked", "overlap", "audit", "__init__"}, {"lightning"}, {"tools"}]
# "__init__": a name taken from ``gradsync`` itself, the public face of every tier up to the features
ADAPTERS = {"_torch.py": "torch", "lightning/_lightning.py": "lightning"}  # the only homes of private names
MAX_LINES = 330


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def rel(path: Path) -> str:
    return str(path.relative_to(PACKAGE))


def part_of(dotted: str) -> str | None:
    """The package part a gradsync module belongs to: its first name under ``gradsync``."""
    bits = dotted.split(".")
    return bits[1] if bits[0] == "gradsync" and len(bits) > 1 else None


def tier(part: str) -> int:
    return next(i for i, names in enumerate(TIERS) if part in names)


def imported_parts(path: Path) -> set[str]:
    """The gradsync package parts a module imports, resolving relative imports."""
    parts = ["gradsync", *path.relative_to(PACKAGE).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts = parts[:-1] + ["__init__"]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = parts[:len(parts) - node.level] if node.level else []
            names = [".".join(base + [node.module]) if node.module else ".".join(base + [a.name]) for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        known = set().union(*TIERS)
        found |= {p if p in known else "__init__" for p in map(part_of, names) if p is not None}
    return found


@pytest.mark.parametrize("level", range(len(TIERS)))
def test_imports_point_one_way(level):
    for path in modules():
        if path.parent == PACKAGE and path.name == "__init__.py":
            continue  # the public face imports what it exports
        own = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        if tier(own) != level:
            continue
        above = {p for p in imported_parts(path) if tier(p) > level}
        assert not above, f"{rel(path)} imports {above}, above its tier {sorted(TIERS[level])}"


def test_the_engine_imports_nothing_above_it():
    """The engine knows no wrapper, optimizer code, feature, hook catalogue or tool."""
    for path in (PACKAGE / "engine").rglob("*.py"):
        assert imported_parts(path) <= {"engine", "_torch", "process"}, (rel(path), imported_parts(path))


def test_the_probe_sees_relative_imports():
    assert imported_parts(PACKAGE / "sharded" / "wrapper.py") >= {"ddp", "engine", "sharded"}
    assert "tools" in imported_parts(PACKAGE / "tools" / "bench" / "run.py")


def test_import_gradsync_loads_no_tool():
    probe = ("import sys, torch; before = set(sys.modules); import gradsync; "
             "print(' '.join(sorted(set(sys.modules) - before)))")
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}  # this checkout, as conftest.py does
    new = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         timeout=120, env=env).stdout.split()
    assert "gradsync.engine.reducer" in new  # the probe saw the import
    assert not [m for m in new if m.startswith(("gradsync.tools", "matplotlib", "tqdm"))]


def foreign_private_names(path: Path) -> list[str]:
    """Every private name used on something else: ``x._name`` on anything but ``self``/``cls`` (any
    attribute chain: ``torch._C.Future``, ``group._get_backend``, ``m._modules``), and ``_name``
    imported from another module (gradsync's own adapter modules ``_torch``/``_torch_range`` aside)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            found += [f"{node.lineno}: from {module} import {a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__") and a.name not in ("_torch", "_torch_range")]
            if any(p.startswith("_") and not p.startswith("__") for p in module.split(".")[1:]) \
                    and not module.startswith("gradsync."):
                found.append(f"{node.lineno}: from {module}")
    return found


# Python's own documented names that happen to start with an underscore, with why each is used
STDLIB = {"os._exit": "a forked rank must exit without running the parent's atexit handlers (tools/launch.py)"}


def test_private_names_only_in_one_adapter_per_library():
    """No private name of torch, a framework or another gradsync module outside its adapter."""
    offenders = {}
    for path in modules():
        if rel(path) in ADAPTERS:
            continue
        found = [f for f in foreign_private_names(path) if f.split(": ", 1)[1] not in STDLIB]
        if found:
            offenders[rel(path)] = found
    assert not offenders, offenders
    for adapter in ADAPTERS:  # the probe sees them
        assert foreign_private_names(PACKAGE / adapter), adapter


def test_the_probe_sees_private_names_on_any_object():
    code = "def f(group, m):\n    group._get_backend(1)\n    return m._modules, torch._foreach_div_\n"
    probe = PACKAGE.parent / "probe_private.py"
    probe.write_text(code)
    try:
        assert len(foreign_private_names(probe)) == 3
    finally:
        probe.unlink()


def test_at_most_one_module_rebinds_module_level_state():
    """Process-wide state lives in ``process.py`` (``process.state``); no module rebinds a global."""
    rebinding = [rel(p) for p in modules() if any(isinstance(n, ast.Global) for n in ast.walk(ast.parse(p.read_text())))]
    assert len(rebinding) <= 1, rebinding


def test_no_module_is_over_the_size_limit():
    big = {rel(p): n for p in modules() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, big


def test_no_mixins():
    """A class has at most one gradsync base class: behaviour comes by composition, not by mixing in."""
    ours = {node.name for p in modules() for node in ast.walk(ast.parse(p.read_text())) if isinstance(node, ast.ClassDef)}
    mixed = {}
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b).split(".")[-1] for b in node.bases]
                if len([b for b in bases if b in ours]) > 1 or node.name.endswith(("Mixin", "Methods", "Extras")):
                    mixed[f"{rel(path)}:{node.name}"] = bases
    assert not mixed, mixed


def elastic_identifiers(path: Path) -> list[str]:
    """Names in code (not comments, docstrings or other strings) that speak of membership or elastic."""
    words = ("elastic", "membership")
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            names = [node.name]
        elif isinstance(node, ast.arg):
            names = [node.arg]
        elif isinstance(node, ast.alias):
            names = [node.name, node.asname or ""]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        found += [f"{getattr(node, 'lineno', '?')}: {n}" for n in names if any(w in n.lower() for w in words)]
    return found


def test_elastic_lives_in_its_package():
    """Outside the ``elastic/`` folders (the feature, and its tools ``gradsync run`` and the elastic demo),
    at most two modules speak of membership in code: the package's public face (``gradsync.elastic``) and
    the demo's command line. The engine offers a commit protocol; the wrapper and the accumulator announce
    themselves; ``elastic/attach.py`` listens."""
    outside = {rel(p): elastic_identifiers(p) for p in modules()
               if "elastic" not in p.relative_to(PACKAGE).parts[:-1] and elastic_identifiers(p)}
    assert len(outside) <= 2, outside
    assert elastic_identifiers(PACKAGE / "elastic" / "membership.py")  # the probe sees them
