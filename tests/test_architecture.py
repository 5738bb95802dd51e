"""The structure stays as docs/architecture.md draws it: no import cycles, no oversized modules.

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
MAX_LINES = 500


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


def _source_files() -> list[str]:
    """The project's own modules: tracked .py files outside tests/, bench/ and migrations."""
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    return [f for f in files if not f.startswith(("tests/", "bench/")) and "/migrations/" not in f]


def test_no_module_over_500_lines():
    big = {f: n for f in _source_files() if (n := len((ROOT / f).read_text().splitlines())) > MAX_LINES}
    assert not big, f"split these along an idea (limit {MAX_LINES} lines): {big}"


def test_no_function_over_80_lines():
    """A function that long does several things; the issue that split the trainer, the
    simulator and the start-time prediction measured 117, 170 and 166 lines before."""
    long = {}
    for f in _source_files():
        for node in ast.walk(ast.parse((ROOT / f).read_text(), f)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 80:
                    long[f"{f}:{node.name}"] = n
    assert not long, f"split these functions (limit 80 lines): {long}"
