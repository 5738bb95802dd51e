"""What every command module of the CLI shares (app.py and experiment.py both import it, so neither
imports the other for it): the API client from the saved login, rich consoles, JSON output, and
reading a YAML/JSON document bounded like the server (trainyard/textdoc.py)."""
from __future__ import annotations

import json

import click

from . import config
from .client import Api
from .errors import CliError


def api() -> Api:
    login = config.load()
    return Api(login.url, login.token)


def console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, highlight=False)


def print_json(data) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True))


def load_doc(path: str, where: str, text: str | None = None):
    """The YAML (or JSON) document in `path` (or `text`), bounded like the server's
    (trainyard/textdoc.py: size, depth, no anchors or aliases), or CliError."""
    from trainyard.textdoc import DocError, load_yaml

    try:
        if text is None:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        return load_yaml(text)
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror or exc}") from None
    except DocError as exc:
        if exc.where is not None:
            raise CliError(f"{where} is not valid YAML{exc.where}: {exc.problem}") from None
        raise CliError(f"{where}: {exc}") from None
    except UnicodeDecodeError:
        raise CliError(f"{where} is not UTF-8 text") from None
