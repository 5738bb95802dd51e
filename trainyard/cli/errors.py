"""The CLI's one kind of expected failure: a one-line message, exit code 2 (app.TrainyardGroup prints it)."""
from __future__ import annotations

import click

NOT_LOGGED_IN = "not logged in: run `trainyard login URL` or set TRAINYARD_URL and TRAINYARD_TOKEN"


class CliError(click.ClickException):
    exit_code = 2
