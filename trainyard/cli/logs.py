"""`trainyard logs`: a job's kept logs over GET /api/v1/jobs/<id>/logs/ (one attempt and one rank
per request, paged by line offset; docs/architecture.md, section 7).

Without --attempt: the newest attempt that has logs (the API's default); without --rank: every
rank that attempt kept a file for, one after the other, each line prefixed "[rank R]". With -f the
files are polled from their next offsets until the job has ended (offsets make the follow exact:
no line twice, none skipped); a newer attempt (a restart) is followed from its first line.
Every line goes through `safe.clean`: a job's escape sequences are shown, never obeyed.
"""
from __future__ import annotations

import time

import click

from trainyard.status import TERMINAL

from .client import Api
from .safe import clean

PAGE = 5000
POLL_S = 1.0
SETTLE_S = 3.0  # after the job ended, the relay may still be writing its last lines


class LogReader:
    """Prints each kept line of the chosen attempt once, remembering every rank's next offset."""

    def __init__(self, api: Api, job_id: int, *, rank: int | None, attempt: int | None):
        self.api, self.job_id, self.rank, self.wanted = api, job_id, rank, attempt
        self.attempt: int | None = None
        self.offsets: dict[int, int] = {}  # rank -> next line to print

    def _page(self, attempt: int | None, rank: int, offset: int, limit: int = PAGE) -> dict:
        return self.api.get(f"/api/v1/jobs/{self.job_id}/logs/",
                            params={"attempt": attempt, "rank": rank, "offset": offset, "limit": limit},
                            doing=f"logs of job {self.job_id}")

    def _drain(self, rank: int) -> int:
        printed = 0
        while True:
            body = self._page(self.attempt, rank, self.offsets.get(rank, 0))
            lines = body.get("lines") or []
            for line in lines:  # a job's own bytes: control sequences shown, never sent to the terminal
                line = clean(line)
                click.echo(line if self.rank is not None else f"[rank {rank}] {line}")
            printed += len(lines)
            self.offsets[rank] = body.get("offset", 0) + len(lines)
            if body.get("next_offset") is None or not lines:
                return printed

    def read(self) -> int:
        """Print what is new in every rank of the attempt (--attempt, else the newest with logs)."""
        probe = self._page(self.wanted, self.rank or 0, 0, limit=1)
        attempt = probe.get("attempt")
        if attempt is None:
            return 0  # the job never started
        if attempt != self.attempt:
            if self.attempt is not None:
                click.echo(f"--- attempt {attempt} ---")
            self.attempt, self.offsets = attempt, {}
        if self.rank is not None:
            ranks = [self.rank]
        else:
            ranks = next((a.get("ranks") or [] for a in probe.get("attempts") or [] if a.get("id") == attempt), [])
        return sum(self._drain(rank) for rank in sorted(ranks))


def print_logs(api: Api, job_id: int, *, rank: int | None, attempt: int | None, follow: bool) -> None:
    reader = LogReader(api, job_id, rank=rank, attempt=attempt)
    if not follow:
        reader.read()
        return
    ended_at = None
    while True:
        status = api.get(f"/api/v1/jobs/{job_id}/", doing=f"job {job_id}")["status"]
        printed = reader.read()
        if status in TERMINAL:
            ended_at = ended_at or time.monotonic()
            if not printed and time.monotonic() - ended_at >= SETTLE_S:
                return
        time.sleep(POLL_S)
