"""The runtime under workers/runtime runs under torchrun and must never import Django or the control plane."""
import ast
import subprocess
import sys
from pathlib import Path

RUNTIME = Path(__file__).resolve().parent.parent / "workers" / "runtime"
FORBIDDEN = ("django", "jobs", "controlplane", "rest_framework", "channels")


def test_runtime_sources_import_no_django():
    offenders = []
    for path in RUNTIME.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert not offenders
    assert list(RUNTIME.rglob("*.py")), "runtime sources not found"


def test_importing_every_runtime_module_loads_no_django():
    mods = [f"workers.runtime.{p.stem}" for p in RUNTIME.glob("*.py") if p.stem != "__main__"]
    code = ("import importlib, sys\n"
            f"for m in {mods!r}: importlib.import_module(m)\n"
            f"bad = [m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r}]\n"
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=RUNTIME.parent.parent, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
