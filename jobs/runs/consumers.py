"""Websocket consumers: /ws/jobs/<id>/ and /ws/cluster/ (docs/architecture.md, section 7). Thin: check access,
read through selectors, forward group messages.

Flow control: every message carries `seq`; clients ack what they handled ({"type": "ack",
"seq": n}). A connection holds at most MAX_INFLIGHT unacked messages. Past that it stops sending
telemetry (the relay and other sockets never wait on it: group_send only enqueues) and remembers
the first step it skipped; once the client acks its way back under half the window it gets one
`window` from the database instead of the backlog (the reduced steps from there on, bucketed, and the
named ranks' samples: jobs/telemetry/payloads.py chart_telemetry).
"""
from __future__ import annotations

import asyncio
import json
import time

import orjson

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from channels.consumer import get_handler_name
from django.conf import settings

from trainyard.textdoc import echo

from jobs.runs import payloads as runs_payloads
from jobs.telemetry import payloads as telemetry_payloads, selectors as telemetry_selectors
from jobs.access import selectors as access_selectors, tokens

MAX_INFLIGHT = 32
WINDOW_POINTS = telemetry_payloads.SNAPSHOT_POINTS  # points per curve in a snapshot or window
# Autobahn (daphne) refuses frames over 1 MiB and drops the socket; 1000 samples are ~330 KB and
# 500 step rows at most ~400 KB (12 fields of 4 numbers), so snapshots and windows go out in chunks.
CHUNK_SAMPLES = 1000
CHUNK_STEPS = 500
CLUSTER_MIN_INTERVAL_S = 0.5  # node heartbeats and queue changes coalesce to at most 2 pushes/s


# Messages whose handlers never touch the database. Channels runs close_old_connections in a
# worker thread before every handler; for these that thread hop (~0.5 ms, twice per telemetry
# message counting its ack) was ~12% of daphne's CPU at 2k samples/s. Handlers that do use the
# database go through database_sync_to_async, which closes stale connections itself.
NO_DB_MESSAGES = frozenset({"websocket.receive", "job.telemetry", "job.log"})


# Open sockets per user id in this process (one event loop: no lock needed). A per-process count:
# with N daphne processes a user may hold up to N x the cap.
_open_sockets: dict[int, int] = {}
SOCKET_CAP_CODE = 4429  # 4000-4999: application close codes; "429" as in HTTP Too Many Requests


class _FlowControlled(AsyncJsonWebsocketConsumer):
    seq = 0
    acked = 0
    auth_groups: tuple[str, ...] = ()
    _counted_user: int | None = None

    async def dispatch(self, message):
        if message["type"] in NO_DB_MESSAGES:
            handler = getattr(self, get_handler_name(message), None)
            if handler:
                return await handler(message)
        return await super().dispatch(message)

    async def push(self, message: dict) -> None:
        # orjson: a snapshot of 1,500 step rows is ~2 MB of JSON, ~120 ms in json.dumps and ~10 ms here
        # (bench/ws_snapshot.py); a NaN becomes null instead of failing the send
        self.seq += 1
        message["seq"] = self.seq
        await self.send(text_data=orjson.dumps(message, default=str, option=orjson.OPT_NON_STR_KEYS).decode())

    async def push_encoded(self, kind: str, **encoded: str) -> None:
        """push({"type": kind, field: <value already encoded as JSON text>, ...}) without decoding them."""
        self.seq += 1
        fields = "".join(f',"{field}":{text}' for field, text in encoded.items())
        await self.send(text_data=f'{{"type":"{kind}","seq":{self.seq}{fields}}}')

    @property
    def congested(self) -> bool:
        return self.seq - self.acked >= MAX_INFLIGHT

    async def receive(self, text_data=None, bytes_data=None, **kwargs):
        try:
            content = json.loads(text_data) if text_data is not None else None
        except (ValueError, RecursionError):  # a frame of 500,000 "[" nests past the parser's recursion
            content = None
        if not isinstance(content, dict) or not isinstance(content.get("type"), str):
            await self.send_json({"type": "error", "error": "expected a JSON object with a string 'type'"})
            return
        kind = content["type"]
        if kind == "ack":
            seq = content.get("seq")
            if not isinstance(seq, int) or isinstance(seq, bool) or not 0 <= seq <= self.seq:
                await self.send_json({"type": "error", "error": f"ack.seq must be an integer in [0, {self.seq}]"})
                return
            self.acked = max(self.acked, seq)
            await self.caught_up()
        elif kind == "ping":
            await self.send_json({"type": "pong"})
        else:
            await self.send_json({"type": "error", "error": f"unknown message type {echo(kind)}"})

    async def caught_up(self) -> None:
        """Called after every ack; subclasses send what a congested client missed."""

    async def join_auth_groups(self, user) -> bool:
        """Join the groups that revoking this socket's credentials closes it through (jobs/signals.py):
        its user's (deactivated or deleted) and, when a token opened it, its token's (deleted). False
        if they were revoked already (between the handshake's check and the join)."""
        token_id = self.scope.get("token_id")
        groups = [tokens.user_group(user.pk)] + ([tokens.token_group(token_id)] if token_id is not None else [])
        for group in groups:
            await self.channel_layer.group_add(group, self.channel_name)
        self.auth_groups = tuple(groups)
        return await database_sync_to_async(tokens.still_valid)(user.pk, token_id)

    async def leave_auth_groups(self) -> None:
        for group in self.auth_groups:
            await self.channel_layer.group_discard(group, self.channel_name)

    async def auth_revoked(self, event):
        await self.close(code=tokens.REVOKED_CLOSE_CODE, reason=str(event.get("reason", ""))[:100])

    async def _deny(self, code: int, reason: str = "") -> None:
        await self.accept()
        await self.close(code=code, reason=reason or None)

    async def _claim_socket(self, user) -> bool:
        """Count this socket against the user's cap (settings.TRAINYARD_MAX_SOCKETS_PER_USER, per web
        process); past it, close with SOCKET_CAP_CODE and the reason, and return False."""
        cap = settings.TRAINYARD_MAX_SOCKETS_PER_USER
        if cap and _open_sockets.get(user.pk, 0) >= cap:
            await self._deny(SOCKET_CAP_CODE, f"too many open websockets: at most {cap} per user "
                                              f"(TRAINYARD_MAX_SOCKETS_PER_USER); close another tab")
            return False
        _open_sockets[user.pk] = _open_sockets.get(user.pk, 0) + 1
        self._counted_user = user.pk
        return True

    def _release_socket(self) -> None:
        pk, self._counted_user = self._counted_user, None
        if pk is not None:
            left = _open_sockets.get(pk, 1) - 1
            if left > 0:
                _open_sockets[pk] = left
            else:
                _open_sockets.pop(pk, None)


class JobConsumer(_FlowControlled):
    job_id = 0
    group = ""
    behind_from: int | None = None  # first step not delivered while congested

    async def connect(self):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            return await self._deny(4401)
        self.job_id = int(self.scope["url_route"]["kwargs"]["job_id"])
        visible = await database_sync_to_async(
            lambda: access_selectors.jobs_visible_to(user).filter(pk=self.job_id).exists())()
        if not visible:
            return await self._deny(4404)
        if not await self._claim_socket(user):
            return
        # Join before reading the snapshot: whatever commits in between arrives twice at worst,
        # and clients merge by (attempt, rank, step), so there is never a gap.
        self.group = f"job.{self.job_id}"
        if not await self.join_auth_groups(user):
            return await self._deny(tokens.REVOKED_CLOSE_CODE)
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()
        snapshot = await database_sync_to_async(runs_payloads.job_snapshot)(self.job_id, max_points=WINDOW_POINTS)
        await self.push_chunked(snapshot, "telemetry")

    async def push_chunked(self, message: dict, rest_type: str) -> None:
        """Send `message` with its first CHUNK_STEPS step rows and CHUNK_SAMPLES samples, the rest as
        `rest_type` messages (clients merge steps by (attempt, step) and samples by (attempt, rank,
        step), so the split changes nothing for them)."""
        steps, samples = message.get("steps", []), message["samples"]
        message["steps"], message["samples"] = steps[:CHUNK_STEPS], samples[:CHUNK_SAMPLES]
        await self.push(message)
        i, j = CHUNK_STEPS, CHUNK_SAMPLES
        while i < len(steps) or j < len(samples):
            extra = {k: message[k] for k in ("from_step", "downsampled", "bucketed") if k in message
                     and rest_type == "window"}
            await self.push({"type": rest_type, "steps": steps[i:i + CHUNK_STEPS],
                             "samples": samples[j:j + CHUNK_SAMPLES], **extra})
            i, j = i + CHUNK_STEPS, j + CHUNK_SAMPLES

    async def disconnect(self, code):
        await self.leave_auth_groups()
        self._release_socket()
        if self.group:
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def job_telemetry(self, event):
        """The relay's reduced message (jobs.telemetry.publish.reduced_message: step rows, the named
        ranks' samples and the names, each already encoded as JSON text and spliced into the frame as
        is), or a plain {"samples": [...]} from elsewhere."""
        if "steps_json" in event:
            if not event.get("count"):
                return
            first = event["first_step"]
        else:
            samples = event.get("samples") or []
            if not samples:
                return
            first = min(s["step"] for s in samples)
        if self.behind_from is not None or self.congested:
            self.behind_from = first if self.behind_from is None else min(self.behind_from, first)
            return
        if "steps_json" not in event:
            await self.push({"type": "telemetry", "samples": samples})
            return
        await self.push_encoded("telemetry", steps=event["steps_json"], samples=event["samples_json"],
                                named=event["named_json"])

    async def job_log(self, event):
        if self.behind_from is None and not self.congested:
            await self.push({"type": "log", "rank": event["rank"], "attempt": event["attempt"],
                             "stream": event.get("stream", "stdout"), "lines": event["lines"]})

    async def job_status(self, event):
        await self.push({k: v for k, v in event.items() if k != "type"} | {"type": "status"})

    async def job_event(self, event):
        await self.push({"type": "event", "event": event["event"]})

    async def job_profile(self, event):
        await self.push({"type": "profile", "attempt": event["attempt"], "profile": event["profile"]})

    async def job_checkpoint(self, event):
        await self.push({k: v for k, v in event.items() if k != "type"} | {"type": "checkpoint"})

    async def caught_up(self) -> None:
        if self.behind_from is None or self.seq - self.acked > MAX_INFLIGHT // 2:
            return
        from_step, self.behind_from = self.behind_from, None
        charts = await database_sync_to_async(telemetry_payloads.chart_telemetry)(
            self.job_id, from_step=from_step, max_points=WINDOW_POINTS)
        logs = await database_sync_to_async(telemetry_selectors.job_log_lines)(self.job_id, limit=200)
        await self.push_chunked({"type": "window", "from_step": from_step, "steps": charts["steps"],
                                 "samples": charts["samples"], "named": charts["named"],
                                 "bucketed": charts["bucketed"], "downsampled": True, "logs": logs}, "window")


class ClusterConsumer(_FlowControlled):
    _last_push = 0.0
    _changed_at = 0.0  # time.monotonic() of the latest change heard of: what a push must include
    _scheduled = False
    _missed = False

    async def connect(self):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            return await self._deny(4401)
        if not await self.join_auth_groups(user):
            return await self._deny(tokens.REVOKED_CLOSE_CODE)
        if not await self._claim_socket(user):
            return
        await self.channel_layer.group_add("cluster", self.channel_name)
        await self.accept()
        self._changed_at = time.monotonic()
        state = await database_sync_to_async(runs_payloads.cluster_state)(user, self._changed_at)
        self._last_push = time.monotonic()
        await self.push({"type": "snapshot", **state})

    async def disconnect(self, code):
        await self.leave_auth_groups()
        self._release_socket()
        await self.channel_layer.group_discard("cluster", self.channel_name)

    async def cluster_changed(self, event):
        self._changed_at = time.monotonic()
        if self._scheduled:
            return
        if self.congested:
            self._missed = True  # state messages are whole: the next one replaces what was skipped
            return
        self._scheduled = True
        delay = max(0.0, CLUSTER_MIN_INTERVAL_S - (time.monotonic() - self._last_push))
        # A task, not an inline sleep: the consumer keeps handling acks and pings meanwhile.
        self._task = asyncio.get_running_loop().create_task(self._push_later(delay))

    async def _push_later(self, delay: float):
        try:
            if delay:
                await asyncio.sleep(delay)
        finally:
            self._scheduled = False
        await self._push_state()

    async def _push_state(self):
        state = await database_sync_to_async(runs_payloads.cluster_state)(self.scope["user"], self._changed_at)
        self._last_push = time.monotonic()
        await self.push({"type": "nodes", "nodes": state["nodes"]})
        await self.push({"type": "jobs", "queue": state["queue"], "running": state["running"]})

    async def caught_up(self) -> None:
        if self._missed and self.seq - self.acked <= MAX_INFLIGHT // 2:
            self._missed = False
            await self._push_state()
