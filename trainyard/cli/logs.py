"""`trainyard logs`: a job's kept logs over GET /api/v1/jobs/<id>/logs/, and with -f the new
lines as the job socket delivers them, until the job ends.

-f opens the socket first and reads the history once the socket's snapshot arrives, so no line
falls between the two (a line written in that instant may print twice).
"""
from __future__ import annotations

import click

from .client import Api
from . import watch

PAGE = 5000


def _format(entry, single_rank: bool) -> str:
    if not isinstance(entry, dict):
        return str(entry)
    line = entry.get("line", "")
    return line if single_rank else f"[rank {entry.get('rank')}] {line}"


def history(api: Api, job_id: int, *, rank: int | None, attempt: int | None) -> list:
    """Every kept line, oldest first, paging with offset while the API offers a next page."""
    out, offset = [], None
    while True:
        body = api.get(f"/api/v1/jobs/{job_id}/logs/",
                       params={"rank": rank, "attempt": attempt, "offset": offset, "limit": PAGE},
                       doing=f"logs of job {job_id}")
        if isinstance(body, list):  # a plain list: the whole answer
            return out + body
        out += body.get("lines") or []
        offset = body.get("next_offset")
        if offset is None or not body.get("lines"):
            return out


def _wanted(entry, rank, attempt) -> bool:
    if not isinstance(entry, dict):
        return True
    return (rank is None or entry.get("rank") == rank) and (attempt is None or entry.get("attempt") == attempt)


def print_logs(api: Api, job_id: int, *, rank: int | None, attempt: int | None, follow: bool) -> None:
    single = rank is not None
    if not follow:
        for entry in history(api, job_id, rank=rank, attempt=attempt):
            if _wanted(entry, rank, attempt):
                click.echo(_format(entry, single))
        return
    state = {"started": False}

    def on_message(msg: dict) -> bool:
        kind = msg.get("type")
        if kind == "snapshot" and not state["started"]:
            state["started"] = True
            for entry in history(api, job_id, rank=rank, attempt=attempt):
                if _wanted(entry, rank, attempt):
                    click.echo(_format(entry, single))
            return (msg.get("job") or {}).get("status") in watch.TERMINAL
        if kind == "log":
            for line in msg.get("lines") or []:
                entry = {"rank": msg.get("rank"), "attempt": msg.get("attempt"), "line": line}
                if _wanted(entry, rank, attempt):
                    click.echo(_format(entry, single))
        return kind == "status" and msg.get("status") in watch.TERMINAL

    watch.follow(api, job_id, on_message)
