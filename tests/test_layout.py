"""The package's tiers: core <- layers <- tools, and ``import gradsync`` loads no tool."""
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import gradsync

PACKAGE = Path(gradsync.__file__).parent
TIERS = ["core", "layers", "tools"]  # each may import only the tiers before it


def imported_tiers(path: Path) -> set[str]:
    """Return the gradsync tiers a module imports, resolving relative imports."""
    parts = ["gradsync", *path.relative_to(PACKAGE).with_suffix("").parts]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = parts[:len(parts) - node.level] if node.level else []
            names = [".".join(base + ([node.module] if node.module else []) + ([a.name] if not node.module else []))
                     for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            bits = name.split(".")
            if bits[0] == "gradsync" and len(bits) > 1 and bits[1] in TIERS:
                found.add(bits[1])
    return found


@pytest.mark.parametrize("tier", TIERS)
def test_imports_point_one_way(tier):
    allowed = set(TIERS[:TIERS.index(tier) + 1])
    for path in sorted((PACKAGE / tier).rglob("*.py")):
        assert imported_tiers(path) <= allowed, f"{path.relative_to(PACKAGE)} imports {imported_tiers(path) - allowed}"


def test_the_probe_sees_relative_imports():
    assert imported_tiers(PACKAGE / "layers" / "sharded.py") == {"core", "layers"}
    assert imported_tiers(PACKAGE / "tools" / "bench" / "run.py") == {"tools"}


def test_import_gradsync_loads_no_tool():
    probe = ("import sys, torch; before = set(sys.modules); import gradsync; "
             "print(' '.join(sorted(set(sys.modules) - before)))")
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}  # this checkout, as conftest.py does
    new = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         timeout=120, env=env).stdout.split()
    assert "gradsync.ddp.wrapper" in new  # the probe saw the import
    assert not [m for m in new if m.startswith(("gradsync.tools", "matplotlib", "tqdm"))]


def private_torch_names(path: Path) -> list[str]:
    """Attribute chains under ``torch`` with a private part (``torch._C.Future``, ``x._base`` on a
    torch tensor is not seen), and imports of private torch modules or names."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            chain, cur = [node.attr], node.value
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id in ("torch", "dist", "nn"):
                if any(part.startswith("_") and not part.startswith("__") for part in chain):
                    found.append(".".join([cur.id, *reversed(chain)]))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            names = [node.module, *(a.name for a in node.names)]
            if any(part.startswith("_") and not part.startswith("__") for n in names for part in n.split(".")):
                found.append(f"from {node.module} import {', '.join(a.name for a in node.names)}")
    return found


def test_private_torch_apis_only_in_the_adapter():
    """Every private torch API goes through _torch.py, which says what breaks without each."""
    offenders = {str(p.relative_to(PACKAGE)): private_torch_names(p)
                 for tier in ("core", "layers") for p in sorted((PACKAGE / tier).rglob("*.py"))
                 if p.name != "_torch.py" and private_torch_names(p)}
    assert not offenders, offenders
    assert private_torch_names(PACKAGE / "core" / "_torch.py")  # the probe sees them


def foreign_private_names(path: Path) -> list[str]:
    """``x._name`` on anything but ``self``/``cls``, and ``_name`` imported from another module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom):
            found += [f"{node.lineno}: import {a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_layers_use_the_seam_not_private_names():
    """layers/ reach the core through ddp/seam.py's names (and torch through _torch.py)."""
    offenders = {str(p.relative_to(PACKAGE)): foreign_private_names(p)
                 for p in sorted((PACKAGE / "layers").rglob("*.py")) if foreign_private_names(p)}
    assert not offenders, offenders
    probe = PACKAGE / "core" / "join.py"  # the probe sees a core module's use of the wrapper's state
    assert any("ddp._" in line for line in foreign_private_names(probe))
