"""The runtime runs under torchrun on nodes without the control plane: no Django imports, neither
written in its sources nor pulled in when its modules load."""
import ast
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

FORBIDDEN = ("django", "jobs", "controlplane", "rest_framework", "channels")
RUNTIME = REPO / "workers" / "runtime"


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_no_runtime_module_imports_the_control_plane():
    files = sorted(RUNTIME.rglob("*.py"))
    assert len(files) >= 8
    offenders = {str(f.relative_to(REPO)): sorted(_imported_roots(f) & set(FORBIDDEN)) for f in files}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_importing_every_runtime_module_loads_no_django():
    mods = [f"workers.runtime.{p.stem}" for p in RUNTIME.glob("*.py") if p.stem != "__main__"]
    code = ("import importlib, sys\n"
            f"for m in {mods!r}: importlib.import_module(m)\n"
            f"bad = [m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r}]\n"
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
