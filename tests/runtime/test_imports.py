"""The runtime runs under torchrun on nodes without the control plane: no Django imports."""
import ast
from pathlib import Path

from tests.conftest import REPO

FORBIDDEN = ("django", "jobs", "controlplane")
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
