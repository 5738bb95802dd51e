"""The structure stays as docs/architecture.md draws it: no import cycles, no oversized modules,
classes, functions or scripts.

import-linter (`make lint`) checks the layer arrows; these check what its contracts cannot say.
"""
from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import grimp
import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("trainyard", "jobs", "workers", "controlplane")
MAX_LINES = 500        # a module or a JavaScript file
MAX_CLASS_LINES = 300  # a class that long holds several ideas (the relay's was 394 lines)
MAX_FUNCTION_LINES = 80


def _module_graph() -> nx.DiGraph:
    g = grimp.build_graph(*PACKAGES, cache_dir=None)
    dg = nx.DiGraph()
    for m in g.modules:
        dg.add_node(m)
        for imported in g.find_modules_directly_imported_by(m):
            # "import a.b.c" also runs a/__init__ and a/b/__init__; those edges are the
            # packages' own, not a cycle between ideas, so only module-to-module arrows count.
            dg.add_edge(m, imported)
    return dg


def test_no_import_cycles_between_modules():
    """Lazy imports inside functions count too: a cycle hidden in a function is still a cycle."""
    dg = _module_graph()
    cycles = [sorted(c) for c in nx.strongly_connected_components(dg) if len(c) > 1]
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def _tracked(pattern: str) -> list[str]:
    return subprocess.run(["git", "ls-files", pattern], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.split()


def _source_files() -> list[str]:
    """The project's own Python: tracked .py files outside tests/ and migrations (bench/ included:
    a benchmark is read, and changed, as often as the code it measures)."""
    return [f for f in _tracked("*.py") if not f.startswith("tests/") and "/migrations/" not in f]


def _js_files() -> list[str]:
    """Our JavaScript, not the vendored libraries (static/vendor/)."""
    return [f for f in _tracked("*.js") if not f.startswith("static/vendor/")]


def _lines(f: str) -> int:
    return len((ROOT / f).read_text().splitlines())


def _defs(kinds: tuple[type, ...], limit: int) -> dict[str, int]:
    long = {}
    for f in _source_files():
        for node in ast.walk(ast.parse((ROOT / f).read_text(), f)):
            if isinstance(node, kinds) and (n := node.end_lineno - node.lineno + 1) > limit:
                long[f"{f}:{node.name}"] = n
    return long


def test_the_limits_see_the_files_they_are_for():
    """A pattern that matched nothing would make the tests below pass by checking nothing."""
    assert "jobs/telemetry/relay.py" in _source_files() and "bench/telemetry.py" in _source_files()
    assert "static/js/job.js" in _js_files() and not any(f.startswith("static/vendor") for f in _js_files())


def test_no_module_over_500_lines():
    big = {f: n for f in _source_files() if (n := _lines(f)) > MAX_LINES}
    assert not big, f"split these along an idea (limit {MAX_LINES} lines): {big}"


def test_no_javascript_file_over_500_lines():
    big = {f: n for f in _js_files() if (n := _lines(f)) > MAX_LINES}
    assert not big, f"split these along an idea (limit {MAX_LINES} lines): {big}"


def test_no_class_over_300_lines():
    long = _defs((ast.ClassDef,), MAX_CLASS_LINES)
    assert not long, f"split these classes along their ideas (limit {MAX_CLASS_LINES} lines): {long}"


def test_no_function_over_80_lines():
    """A function that long does several things; the issue that split the trainer, the
    simulator and the start-time prediction measured 117, 170 and 166 lines before."""
    long = _defs((ast.FunctionDef, ast.AsyncFunctionDef), MAX_FUNCTION_LINES)
    assert not long, f"split these functions (limit {MAX_FUNCTION_LINES} lines): {long}"
