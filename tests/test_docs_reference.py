"""The docs cannot drift from the code: the generated references are fresh, the layer order in
docs/architecture.md is pyproject.toml's, and every path the docs name exists. No processes.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ARCH = ROOT / "docs" / "architecture.md"
DOMAIN_CONTRACT = "jobs: the domains, each importing only the ones below it"
# A backticked repository path: starts at one of the project's top folders.
DOCS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md")) + ["README.md"]
PATH_RE = re.compile(r"`((?:jobs|trainyard|workers|controlplane|scripts|tests|bench|deploy|docs|examples)/[^`\s]*)`")


def _generator():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "scripts" / "gen_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", ["jobspec.md", "rest-api.md"])
def test_generated_references_are_fresh(name):
    gen = _generator()
    text = gen.jobspec_markdown() if name == "jobspec.md" else gen.rest_api_markdown()
    path = ROOT / "docs" / "reference" / name
    assert path.exists(), f"docs/reference/{name} is missing: run make docs"
    assert path.read_text() == text, f"docs/reference/{name} is stale: run make docs"


def _between(text: str, start: str, end: str) -> str:
    assert start in text and end in text, f"docs/architecture.md lost its {start} ... {end} markers"
    return text.split(start, 1)[1].split(end, 1)[0]


def test_architecture_layer_order_is_pyprojects():
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in contracts if c["name"] == DOMAIN_CONTRACT]
    block = _between(ARCH.read_text(), "<!-- domain-layers:start -->", "<!-- domain-layers:end -->")
    written = [ln.strip() for ln in block.splitlines() if ln.strip() and not ln.startswith("```")]
    assert written == contract["layers"], (
        f"docs/architecture.md's domain order differs from pyproject.toml's contract {DOMAIN_CONTRACT!r}")


def test_behaviour_table_paths_exist():
    table = _between(ARCH.read_text(), "<!-- behaviours:start -->", "<!-- behaviours:end -->")
    rows = [ln for ln in table.splitlines() if ln.startswith("|") and not ln.startswith("|---")][1:]
    assert len(rows) >= 8, "the 'where each behaviour lives' table lost rows"
    for row in rows:
        paths = PATH_RE.findall(row)
        assert paths, f"a behaviour names no file: {row}"
        missing = [p for p in paths if not (ROOT / p).exists()]
        assert not missing, f"docs/architecture.md's behaviour table names missing paths {missing}: {row}"


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_the_docs_name_exists(doc):
    """A path with a placeholder (`<id>`, `*`, `{...}`) is a pattern, not a file: skipped."""
    text = (ROOT / doc).read_text()
    missing = {p for p in PATH_RE.findall(text)
               if not re.search(r"[<>*{}$]", p) and not (ROOT / p.rstrip(".,:;)")).exists()}
    missing = sorted(missing)
    assert not missing, f"{doc} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_resolve(doc):
    text = (ROOT / doc).read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    broken = [t for t in links if not t.startswith(("http://", "https://", "mailto:"))
              and not (ROOT / os.path.dirname(doc) / t).exists()]
    assert not broken, f"{doc} links to files that do not exist: {broken}"


def test_readme_cli_commands_parse():
    """The README's first job must be a command line the CLI accepts (parsed, not run)."""
    from trainyard.cli.app import cli

    lines = [ln.split("#", 1)[0] for ln in (ROOT / "README.md").read_text().splitlines()
             if ln.startswith(".venv/bin/trainyard ")]
    assert any(" submit " in ln for ln in lines), "README.md shows no `trainyard submit`"
    for ln in lines:
        name, *args = shlex.split(ln)[1:]
        args = ["1" if a == "ID" else a for a in args]
        cmd = cli.get_command(None, name)
        assert cmd is not None, f"README.md runs `trainyard {name}`, which does not exist"
        cmd.make_context(name, args)  # raises click.UsageError on an unknown option or argument
        for a in args:
            if a.startswith("examples/"):
                assert (ROOT / a).exists(), f"README.md's `trainyard {name}` names {a}, which does not exist"


def test_every_control_plane_module_is_named_in_architecture():
    """Section 5 lists each domain's files: a new module must be placed there too."""
    text = ARCH.read_text()
    modules = [p.relative_to(ROOT).as_posix() for p in (ROOT / "jobs").rglob("*.py")
               if p.name != "__init__.py" and not {"migrations", "management"} & set(p.parts)]
    missing = sorted(m for m in modules if f"`{m}`" not in text)
    assert not missing, f"docs/architecture.md, section 5, does not say what these do: {missing}"


def test_domain_tables_are_the_models():
    """Each domain's `Tables (jobs/models/<domain>.py): ...` line names exactly the models defined there."""
    import ast

    lines = re.findall(r"^Tables \(`(jobs/models/\w+\.py)`\): (.*?)\. Bus:", ARCH.read_text(), re.M)
    assert len(lines) == len(list((ROOT / "jobs" / "models").glob("[!_]*.py"))), "a domain's Tables line is missing"
    for path, names in lines:
        tree = ast.parse((ROOT / path).read_text())
        defined = {n.name for n in tree.body if isinstance(n, ast.ClassDef) and not n.name.startswith("_")}
        assert set(re.findall(r"`(\w+)`", names)) == defined, f"docs/architecture.md's tables of {path}"
