"""Following a job over its websocket (/ws/jobs/<id>/, `Authorization: Token <key>`, no Origin):
`trainyard watch` (a live progress bar) and `trainyard logs -f` (log lines as they come).

The socket sends a `snapshot`, then `telemetry` / `window` samples (one per rank per step),
`status`, `event`, `log` and `checkpoint` messages, each with a `seq` the client acks
(docs/architecture.md, section 7). A dropped socket is reopened; when the job has meanwhile
finished, its final state is read over REST.
"""
from __future__ import annotations

import json
import time

from trainyard.status import SUCCEEDED, TERMINAL

from .client import Api
from .errors import CliError
from .safe import clean, text

RECONNECTS = 5  # attempts in a row that receive nothing, then the CLI gives up


class JobState:
    """The job as the socket's messages describe it: status, step, total, the newest samples."""

    def __init__(self, job_id: int):
        self.job_id = job_id
        self.name = ""
        self.status = ""
        self.reason = ""
        self.step = 0
        self.total = 0
        self.attempt: int | None = None
        self.latest: dict[int, dict] = {}  # rank -> newest sample of the newest attempt
        self.seen_events: set[int] = set()

    def take_job(self, job: dict) -> None:
        self.name, self.total = job.get("name", ""), job.get("total_steps") or 0
        self.status, self.reason = job.get("status", ""), job.get("status_reason", "")
        self.step = max(self.step, job.get("step") or 0)

    def take_samples(self, samples: list[dict]) -> None:
        for s in samples:
            attempt, rank = s.get("attempt"), s.get("rank")
            if attempt is None or rank is None:
                continue
            if self.attempt is None or attempt > self.attempt:
                self.attempt, self.latest = attempt, {}
            if attempt == self.attempt and s.get("step", 0) >= self.latest.get(rank, {}).get("step", -1):
                self.latest[rank] = s
        if self.latest:
            self.step = max(s["step"] for s in self.latest.values())

    @property
    def loss(self) -> float | None:
        losses = [s["loss"] for s in self.latest.values() if s["step"] == self.step and s.get("loss") is not None]
        return sum(losses) / len(losses) if losses else None

    @property
    def samples_per_s(self) -> float | None:
        rates = [s["samples_per_s"] for s in self.latest.values() if s.get("samples_per_s") is not None]
        return sum(rates) if rates else None  # each rank reports its own rate; the job's is the sum

    def apply(self, msg: dict) -> list[str]:
        """Fold one message in; return the lines worth printing (status changes, new events)."""
        kind, out = msg.get("type"), []
        before = self.status
        if kind == "snapshot":
            self.take_job(msg.get("job") or {})
            self.take_samples(msg.get("samples") or [])
            self.seen_events.update(e["id"] for e in msg.get("events") or [] if "id" in e)
            out.append(f"job {self.job_id} ({self.name}): {self.status}" + (f" ({self.reason})" if self.reason else ""))
            return out
        if kind in ("telemetry", "window"):
            self.take_samples(msg.get("samples") or [])
        elif kind == "status":
            self.status, self.reason = msg.get("status", self.status), msg.get("status_reason", "")
            if msg.get("step"):
                self.step = max(self.step, msg["step"])
            if self.status != before:
                out.append(f"status {before} -> {self.status}" + (f" ({self.reason})" if self.reason else ""))
        elif kind == "event":
            event = msg.get("event") or {}
            if event.get("id") not in self.seen_events:
                self.seen_events.add(event.get("id"))
                out.append(f"event {event.get('kind', '?')}: {event.get('message', '')}")
        return out

    def summary(self) -> str:
        parts = [f"job {self.job_id} {self.status}", f"step {self.step}/{self.total}"]
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4g}")
        if self.reason:
            parts.append(self.reason)
        return ", ".join(parts)


def follow(api: Api, job_id: int, on_message, on_idle=lambda: None) -> None:
    """Call on_message(msg) for every socket message until it returns True; reconnect on drops.
    on_idle() runs about once a second while nothing arrives."""
    from websockets.exceptions import ConnectionClosed, InvalidHandshake
    from websockets.sync.client import connect

    url, failures = api.ws_url(f"/ws/jobs/{job_id}/"), 0
    while True:
        try:
            with connect(url, additional_headers={"Authorization": f"Token {api.token}"},
                         open_timeout=30, max_size=None) as ws:
                while True:
                    try:
                        raw = ws.recv(timeout=1.0)
                    except TimeoutError:
                        on_idle()
                        continue
                    failures = 0
                    msg = json.loads(raw)
                    if isinstance(msg.get("seq"), int):
                        ws.send(json.dumps({"type": "ack", "seq": msg["seq"]}))
                    if on_message(msg):
                        return
        except ConnectionClosed as exc:
            code = exc.rcvd.code if exc.rcvd else None
            if code == 4401:
                raise CliError("the server refused the token on the job socket: run `trainyard login URL` again") \
                    from None
            if code == 4404:
                raise CliError(f"job {job_id} not found (or not visible to you)") from None
            problem = f"closed with code {code}"
        except (OSError, InvalidHandshake, TimeoutError) as exc:
            problem = str(exc) or type(exc).__name__
        failures += 1  # in a row without a message received
        if failures >= RECONNECTS:
            raise CliError(f"lost the job socket {url}: {problem}") from None
        try:
            job = api.get(f"/api/v1/jobs/{job_id}/", doing=f"job {job_id}")
        except CliError as exc:  # the server itself may be restarting: retry within the same budget
            job, problem = {}, exc.format_message()
        if job.get("status") in TERMINAL:
            on_message({"type": "snapshot", "job": job, "samples": [], "events": []})
            return
        time.sleep(min(2.0 ** (failures - 1), 10.0))  # 1, 2, 4, 8 s: ~15 s for a server to come back


def watch(api: Api, job_id: int, console) -> int:
    """A live progress bar until the job ends: 0 if it SUCCEEDED, 1 otherwise."""
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    state = JobState(job_id)
    progress = Progress(TextColumn("[bold]{task.fields[status]}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[rate]} samples/s"),
                        TextColumn("ETA"), TimeRemainingColumn(), console=console, transient=False)
    task = progress.add_task("job", total=None, status="…", loss="-", rate="-")

    def refresh():
        # the status column is a markup template ("[bold]{status}"): its value is cleaned and escaped
        progress.update(task, completed=state.step, total=state.total or None, status=escape(clean(state.status)),
                        loss=f"{state.loss:.4g}" if state.loss is not None else "-",
                        rate=f"{state.samples_per_s:.1f}" if state.samples_per_s is not None else "-")

    def on_message(msg: dict) -> bool:
        for line in state.apply(msg):  # server text (event messages, reasons): shown, never obeyed
            progress.console.print(text(line), highlight=False)
        refresh()
        return state.status in TERMINAL

    with progress:
        follow(api, job_id, on_message)
    console.print(text(state.summary()), highlight=False)
    return 0 if state.status == SUCCEEDED else 1
