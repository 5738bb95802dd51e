"""The `trainyard` command line client (docs/user-guide.md, "The `trainyard` CLI").

Talks to a control plane over its REST API and the job websocket only: no Django, no torch.
Modules: config (the login file), client (HTTP and websocket plumbing, one-line errors), pack
(code bundles honouring .gitignore / .trainyardignore), watch (live progress and log follow),
render (tables), app (the click commands). `python -m trainyard.cli` runs the same app as the
console script.
"""
from __future__ import annotations


def main() -> None:
    """The console script's entry point (pyproject.toml [project.scripts])."""
    from .app import cli

    cli.main(prog_name="trainyard")
