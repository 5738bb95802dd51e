"""Staff page: the relay's dead letters (keys.DEADLETTER_STREAM), newest first, read-only.

The entries the relay refused (unparseable, naming another job's attempt, a checkpoint not on
disk, raising when applied) with the reason, the stream and id they came from, and the first
bytes of their data; /metrics counts them (trainyard_relay_deadletter_total)."""
from __future__ import annotations

import redis
from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.shortcuts import render

from jobs.telemetry import entries

PAGE = 200


@login_required
def dead_letters(request):
    if not request.user.is_staff:
        raise PermissionDenied("only staff may read the relay's dead letters")
    error, rows, total = "", [], 0
    try:
        client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2)
        rows, total = entries.read_dead_letters(client, PAGE), client.xlen(entries.keys.DEADLETTER_STREAM)
    except redis.RedisError as exc:
        error = f"Redis is unreachable: {exc}"
    return render(request, "jobs/dead_letters.html", {
        "rows": rows, "total": total, "error": error, "page": PAGE, "cap": entries.DEADLETTER_MAXLEN})
