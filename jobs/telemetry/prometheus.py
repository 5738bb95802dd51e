"""/metrics: jobs, queue, nodes and the telemetry relay in the Prometheus text exposition format
(version 0.0.4), so an existing Prometheus + Grafana can scrape Trainyard.

Access: a staff session, or `Authorization: Bearer <token>` equal to the environment variable
TRAINYARD_METRICS_TOKEN (compared in constant time; no token configured = no bearer access).
Anything else gets 401 (no or wrong credentials) or 403 (a signed-in non-staff user).

Every family is written with # HELP and # TYPE; label values are escaped as the format asks.
Per-job series exist only for jobs in STARTING/RUNNING/STOPPING, so finished jobs do not pile
up in Prometheus. Relay figures come from the counters the relay keeps in Redis
(trainyard.keys.RELAY_STATS_KEY) plus the job streams' current backlog and the age of their oldest
entry; if Redis cannot be reached, `trainyard_redis_up 0` says so and the rest still renders.
The oldest entry the relay read but never acknowledged (collect_relay_pending), the schedule tick's
duration histogram (collect_scheduler: keys.SCHEDULER_STATS_KEY, written after every tick by
jobs.core.dispatch.scheduler_tick_record) and the queue by team with its waits (collect_team_queue,
from the database) feed deploy/grafana/trainyard.json, whose every expression names only families
this module renders (tests/test_grafana_dashboard.py).
Process liveness (`trainyard_process_up{process=...}`, restarts under `make run`) comes from
jobs/fleet/liveness.py.
"""
from __future__ import annotations

import hmac
import math
import os
import time

import redis
from django.conf import settings
from django.db.models import Count, Max, Sum
from django.http import HttpResponse
from django.utils import timezone

from trainyard import keys

from jobs.fleet import liveness, selectors
from jobs.models import Attempt, ControlPlaneClock, Job, MetricStep, Node, NodeJoinRequest, Quota, SecurityEvent

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TOKEN_ENV = "TRAINYARD_METRICS_TOKEN"
_redis: redis.Redis | None = None


def _client() -> redis.Redis:
    global _redis
    if _redis is None:
        _redis = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2)
    return _redis


def _escape(value) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


class Exposition:
    """Collects metric families, each written once with its HELP and TYPE lines."""

    def __init__(self):
        self.families: dict[str, tuple[str, str, list[str]]] = {}

    def add(self, metric: str, kind: str, help_text: str, value, /, **labels) -> None:
        """One sample (value None: the family is declared, without a sample)."""
        fam = self.families.setdefault(metric, (kind, help_text, []))
        if value is None:
            return
        label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        fam[2].append(f"{metric}{{{label_text}}} {_number(value)}" if label_text else f"{metric} {_number(value)}")

    def histogram(self, metric: str, help_text: str, buckets: list[tuple[float, float]] | None, total: float = 0.0,
                  count: float = 0, /, **labels) -> None:
        """One histogram series: `buckets` as (upper bound, cumulative count), ascending; written as
        metric_bucket{le=...} (ending with le="+Inf" = count), metric_sum and metric_count. buckets
        None: the family is declared, without a sample."""
        fam = self.families.setdefault(metric, ("histogram", help_text, []))
        if buckets is None:
            return
        label_text = "".join(f'{k}="{_escape(v)}",' for k, v in labels.items())
        for le, n in [*((le, n) for le, n in buckets if not math.isinf(le)), (math.inf, count)]:
            fam[2].append(f'{metric}_bucket{{{label_text}le="{_number(float(le))}"}} {_number(n)}')
        tail = f"{{{label_text.rstrip(',')}}}" if label_text else ""
        fam[2].append(f"{metric}_sum{tail} {_number(total)}")
        fam[2].append(f"{metric}_count{tail} {_number(count)}")

    def render(self) -> str:
        out = []
        for name, (kind, help_text, lines) in self.families.items():
            out.append(f"# HELP {name} {help_text.replace(chr(92), chr(92) * 2).replace(chr(10), ' ')}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(lines)
        return "\n".join(out) + "\n"


def collect_jobs(exp: Exposition) -> None:
    counts = dict(Job.objects.values_list("status").annotate(n=Count("id")).values_list("status", "n"))
    for status in Job.Status.values:
        exp.add("trainyard_jobs", "gauge", "Jobs by status.", counts.get(status, 0), status=status)
    queued = Job.objects.filter(status=Job.Status.QUEUED)
    exp.add("trainyard_queue_length", "gauge", "Jobs waiting in the queue.", queued.count())
    exp.add("trainyard_queue_slots", "gauge", "Slots the queued jobs ask for in total.",
            sum(queued.values_list("slots", flat=True)))
    for job in Job.objects.filter(status__in=Job.ACTIVE).select_related("owner").order_by("id"):
        labels = {"job": job.pk, "name": job.name, "owner": job.owner.get_username(), "status": job.status}
        exp.add("trainyard_job_step", "gauge", "Highest step any rank of the job reported.", job.step, **labels)
        exp.add("trainyard_job_total_steps", "gauge", "Steps the job trains for.", job.total_steps, **labels)
        exp.add("trainyard_job_slots", "gauge", "Processes the job runs at once.", job.slots, **labels)
        exp.add("trainyard_job_restarts", "gauge", "Restarts of the job so far.", job.restarts, **labels)
        # The job's per-step rows of its last two steps (MetricStep, index job, step): of those, the
        # step the most ranks reported so far (the newer on a tie: the newest may be still arriving);
        # its loss is the ranks' mean, its throughput the sum over them (mean x count).
        newest = list(MetricStep.objects.filter(job_id=job.pk, step__gte=max(0, job.step - 1))
                      .order_by("-step", "-attempt_id")
                      .values_list("ranks", "loss_mean", "samples_per_s_mean", "samples_per_s_n")[:2])
        row = max(newest, key=lambda r: r[0]) if newest else (0, None, None, 0)
        exp.add("trainyard_job_loss", "gauge", "Latest training loss (mean over ranks).", row[1], **labels)
        exp.add("trainyard_job_samples_per_second", "gauge", "Latest training throughput (sum over ranks).",
                row[2] * row[3] if row[2] is not None else None, **labels)


def collect_security(exp: Exposition) -> None:
    """Refused node reports by kind (jobs.fleet.services.identity) and pending join requests."""
    totals = dict(SecurityEvent.objects.values_list("kind").annotate(n=Sum("count")))
    for kind in sorted(set(totals) | {"bad_signature", "foreign_allocation", "unknown_node"}):
        exp.add("trainyard_security_events_total", "counter",
                "Node reports refused: bad signature, another node's allocation, unregistered node, ...",
                totals.get(kind, 0), kind=kind)
    exp.add("trainyard_node_join_requests", "gauge", "Heartbeats from unregistered nodes awaiting staff approval.",
            NodeJoinRequest.objects.count())


def collect_control_clock(exp: Exposition) -> None:
    """The node check's own clock (jobs/fleet/services/nodes.py, control_plane_clock): stalls seen, the
    latest one's length, and how long the current healthy stretch is (node silence is judged only
    within it)."""
    clock = ControlPlaneClock.objects.filter(pk=1).first()
    exp.add("trainyard_control_plane_stalls_total", "counter", "Gaps between node checks over "
            "TRAINYARD_CONTROL_STALL_S (worker or beat down, database locked).", clock.stalls if clock else 0)
    exp.add("trainyard_control_plane_last_stall_seconds", "gauge", "Length of the latest control-plane stall.",
            clock.last_stall_s if clock else None)
    exp.add("trainyard_control_plane_healthy_seconds", "gauge", "Time since the current healthy stretch began.",
            time.time() - clock.healthy_since.timestamp() if clock and clock.healthy_since else None)


def collect_nodes(exp: Exposition) -> None:
    used = selectors.slots_used_by_node()
    now = time.time()
    for node in Node.objects.order_by("name"):
        for status in Node.Status.values:
            exp.add("trainyard_node_status", "gauge", "1 for the node's current status, 0 for the others.",
                    int(node.status == status), node=node.name, status=status)
        exp.add("trainyard_node_slots", "gauge", "Slots (processes) the node offers.", node.slots, node=node.name)
        exp.add("trainyard_node_slots_used", "gauge", "Slots held by active allocations.", used.get(node.pk, 0),
                node=node.name)
        exp.add("trainyard_node_cpu_percent", "gauge", "CPU utilisation the agent reported.", node.cpu_percent,
                node=node.name)
        exp.add("trainyard_node_mem_percent", "gauge", "Memory utilisation the agent reported.", node.mem_percent,
                node=node.name)
        exp.add("trainyard_node_heartbeat_age_seconds", "gauge", "Seconds since the node's last heartbeat.",
                now - node.last_heartbeat.timestamp() if node.last_heartbeat else None, node=node.name)
        collect_gpus(exp, node)


GPU_GAUGES = (  # (device field, metric, type, help): what the agent reads through NVML per GPU
    ("utilization", "trainyard_node_gpu_utilization_percent", "gauge", "GPU utilisation (NVML), percent."),
    ("memory_used_bytes", "trainyard_node_gpu_memory_used_bytes", "gauge", "GPU memory in use (NVML)."),
    ("memory_bytes", "trainyard_node_gpu_memory_total_bytes", "gauge", "GPU memory in total (NVML)."),
    ("temperature_c", "trainyard_node_gpu_temperature_celsius", "gauge", "GPU core temperature (NVML)."),
    ("ecc_uncorrected", "trainyard_node_gpu_ecc_uncorrected_errors", "gauge",
     "Volatile uncorrected ECC errors since the driver loaded (NVML); above 0 counts toward quarantine."),
    ("xid_errors", "trainyard_node_gpu_xid_errors_total", "counter",
     "Critical Xid events NVML reported since the agent started (resets when it restarts)."),
)


def collect_gpus(exp: Exposition, node: Node) -> None:
    """One series per GPU and figure; a figure NVML does not offer on that GPU has no sample."""
    for _, metric, kind, help_text in GPU_GAUGES:
        exp.add(metric, kind, help_text, None)
    for d in node.devices or []:
        if not isinstance(d, dict) or d.get("kind") != "cuda":
            continue
        labels = {"node": node.name, "gpu": d.get("index", ""), "uuid": d.get("uuid", ""), "model": d.get("name", "")}
        for field, metric, kind, help_text in GPU_GAUGES:
            value = d.get(field)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                exp.add(metric, kind, help_text, value, **labels)


RELAY_COUNTERS = (
    ("samples_total", "trainyard_relay_samples_total", "Metric samples the relay committed and fanned out."),
    ("entries_total", "trainyard_relay_entries_total", "Stream entries the relay committed and acknowledged."),
    ("batches_total", "trainyard_relay_batches_total", "Transactions (rounds) the relay committed."),
    ("publish_errors_total", "trainyard_relay_publish_errors_total",
     "Websocket fan-out messages the relay failed to hand to the channel layer."),
    ("log_lines_kept_total", "trainyard_relay_log_lines_kept_total",
     "Log lines the relay appended to the kept files under the kept log root (since it started)."),
    ("log_lines_not_kept_total", "trainyard_relay_log_lines_not_kept_total",
     "Log lines the relay could not keep on disk: the writer was behind or the disk refused (since it started)."),
    ("deadletter_total", "trainyard_relay_deadletter_total",
     "Stream entries the relay refused (unparseable, naming another job's attempt, a checkpoint not on disk, "
     "raising when applied) and moved to the dead-letter stream."),
    ("db_retries_total", "trainyard_relay_db_retries_total",
     "Rounds the relay retried after a database error (locked, connection lost)."),
    ("orphaned_total", "trainyard_relay_orphaned_entries_total",
     "Stream entries of deleted jobs the relay acknowledged and dropped."),
)
RELAY_GAUGES = (
    ("last_batch_unixtime", "trainyard_relay_last_batch_timestamp_seconds", "Unix time of the last committed batch."),
    ("last_batch_samples", "trainyard_relay_last_batch_samples", "Samples in the last committed batch."),
    ("last_batch_seconds", "trainyard_relay_last_batch_duration_seconds",
     "Parse + commit + fan-out + ack time of the last batch."),
    ("started_unixtime", "trainyard_relay_start_timestamp_seconds", "Unix time the relay started."),
)


def collect_relay(exp: Exposition) -> None:
    try:
        r = _client()
        stats = {k.decode(): v.decode() for k, v in r.hgetall(keys.RELAY_STATS_KEY).items()}
        backlog, pending, oldest_ms = 0, 0, None
        streams = list(r.scan_iter(match=keys.JOB_STREAM_PREFIX + "*", _type="stream", count=1000))
        pipe = r.pipeline(transaction=False)
        for key in streams:
            pipe.xlen(key)
            pipe.xrange(key, count=1)
        replies = pipe.execute()
        for length, first in zip(replies[::2], replies[1::2]):
            backlog += length
            if first:
                ms = int(first[0][0].split(b"-")[0])
                oldest_ms = ms if oldest_ms is None else min(oldest_ms, ms)
        dead_letters = r.xlen(keys.DEADLETTER_STREAM)
        pipe = r.pipeline(transaction=False)
        for key in streams:
            pipe.xpending(key, keys.RELAY_GROUP)
        for reply in pipe.execute(raise_on_error=False):
            if isinstance(reply, dict):
                pending += reply.get("pending") or 0
    except redis.RedisError:
        exp.add("trainyard_redis_up", "gauge", "1 if /metrics could read Redis (bus, relay counters).", 0)
        return
    exp.add("trainyard_redis_up", "gauge", "1 if /metrics could read Redis (bus, relay counters).", 1)
    for key, name, help_text in RELAY_COUNTERS:
        exp.add(name, "counter", help_text, float(stats.get(key, 0)))
    for key, name, help_text in RELAY_GAUGES:
        exp.add(name, "gauge", help_text, float(stats[key]) if key in stats else None)
    exp.add("trainyard_relay_streams", "gauge", "Job telemetry streams in Redis.", len(streams))
    exp.add("trainyard_relay_backlog_entries", "gauge",
            "Entries in job streams not yet committed and acknowledged by the relay.", backlog)
    exp.add("trainyard_relay_deadletter_entries", "gauge",
            "Entries in the dead-letter stream (capped; staff read them at /relay/dead-letters/).", dead_letters)
    exp.add("trainyard_relay_pending_entries", "gauge", "Entries read by the relay but not yet acknowledged.",
            pending)
    # Entry ids are Redis-clock milliseconds, and the relay deletes entries after commit: the oldest
    # remaining entry's age is how far behind the relay is (0 when every stream is drained).
    lag = 0.0
    if oldest_ms is not None:
        now_s, now_us = r.time()
        lag = max(0.0, now_s + now_us / 1e6 - oldest_ms / 1000)
    exp.add("trainyard_relay_lag_seconds", "gauge", "Age of the oldest entry the relay has not committed yet.", lag)


def _redis_down(exp: Exposition) -> bool:
    """collect_relay found Redis unreachable in this render: the later Redis readers do not wait out
    their own connect timeouts too (an unreachable host would cost /metrics seconds each)."""
    fam = exp.families.get("trainyard_redis_up")
    return fam is not None and fam[2] == ["trainyard_redis_up 0"]


def collect_relay_pending(exp: Exposition) -> None:
    """How long the relay has held its oldest entry read but not acknowledged (XPENDING's summary per
    job stream: one pipelined round trip for all of them). Backlog and lag (collect_relay) say the
    relay is behind; this says it is stuck on something it already read (a batch that keeps failing
    to commit, a relay killed mid-round whose entries nobody claimed). Nothing when Redis is away
    (collect_relay has already said trainyard_redis_up 0)."""
    help_text = "Age of the oldest job-stream entry the relay read but has not acknowledged (0: none)."
    if _redis_down(exp):
        exp.add("trainyard_relay_pending_oldest_age_seconds", "gauge", help_text, None)
        return
    try:
        r = _client()
        streams = list(r.scan_iter(match=keys.JOB_STREAM_PREFIX + "*", _type="stream", count=1000))
        pipe = r.pipeline(transaction=False)
        for key in streams:
            pipe.xpending(key, keys.RELAY_GROUP)
        oldest_ms = None
        for reply in pipe.execute(raise_on_error=False):
            if isinstance(reply, dict) and reply.get("pending") and reply.get("min"):
                ms = int(reply["min"].split(b"-")[0])
                oldest_ms = ms if oldest_ms is None else min(oldest_ms, ms)
        age = 0.0
        if oldest_ms is not None:
            now_s, now_us = r.time()
            age = max(0.0, now_s + now_us / 1e6 - oldest_ms / 1000)
    except redis.RedisError:
        exp.add("trainyard_relay_pending_oldest_age_seconds", "gauge", help_text, None)
        return
    exp.add("trainyard_relay_pending_oldest_age_seconds", "gauge", help_text, age)


SCHEDULER_TICK_HELP = "Wall time of the schedule tick (lock wait, decision, placements), from every tick since Redis kept it."


def collect_scheduler(exp: Exposition) -> None:
    """The schedule tick's timings, which jobs.core.dispatch.scheduler_tick_record keeps in
    keys.SCHEDULER_STATS_KEY after each tick (`le:<bound>` cumulative bucket counts, count, sum,
    errors, the last tick). Families without samples when no tick was recorded or Redis is away."""
    stats: dict[str, str] = {}
    if not _redis_down(exp):
        try:
            stats = {k.decode(): v.decode() for k, v in _client().hgetall(keys.SCHEDULER_STATS_KEY).items()}
        except redis.RedisError:
            pass
    buckets = sorted((float(k[3:]), float(v)) for k, v in stats.items() if k.startswith("le:"))
    exp.histogram("trainyard_scheduler_tick_duration_seconds", SCHEDULER_TICK_HELP,
                  buckets if "count" in stats else None, float(stats.get("sum_seconds", 0)), float(stats.get("count", 0)))
    exp.add("trainyard_scheduler_tick_errors_total", "counter", "Schedule ticks that raised (rolled back).",
            float(stats["errors_total"]) if "errors_total" in stats else None)
    exp.add("trainyard_scheduler_last_tick_duration_seconds", "gauge", "Wall time of the latest schedule tick.",
            float(stats["last_seconds"]) if "last_seconds" in stats else None)
    exp.add("trainyard_scheduler_last_tick_timestamp_seconds", "gauge", "Unix time the latest schedule tick ended.",
            float(stats["last_unixtime"]) if "last_unixtime" in stats else None)


NO_TEAM = "(none)"
"""The team label of queued jobs submitted without a team."""


def collect_team_queue(exp: Exposition) -> None:
    """The queue per team (label "(none)" for jobs without one), from one query over the queued jobs:
    length, slots asked for, and how long they have waited. A job waits since it was submitted or,
    if it ran before (preempted, restarted, rolled back), since its latest attempt ended. Every team
    with a quota has a series (0 when nothing of it waits; no wait samples then)."""
    now = timezone.now()
    waits: dict[str, list[tuple[int, float]]] = {name: [] for name in Quota.objects.filter(
        team__isnull=False).values_list("team__name", flat=True)}
    # Two narrow queries (no GROUP BY over the jobs' own columns): the queued jobs, and the latest
    # end among the attempts of those that ran before.
    queued = Job.objects.filter(status=Job.Status.QUEUED)
    last_end = dict(Attempt.objects.filter(job__status=Job.Status.QUEUED, ended_at__isnull=False)
                    .values("job_id").annotate(at=Max("ended_at")).values_list("job_id", "at"))
    for pk, team, slots, created_at in queued.values_list("pk", "team__name", "slots", "created_at"):
        since = max(created_at, last_end[pk]) if pk in last_end else created_at
        waits.setdefault(team if team is not None else NO_TEAM, []).append(
            (slots, max(0.0, (now - since).total_seconds())))
    for team in sorted(waits):
        jobs = waits[team]
        exp.add("trainyard_team_queue_length", "gauge", "Jobs waiting in the queue, by team.", len(jobs), team=team)
        exp.add("trainyard_team_queue_slots", "gauge", "Slots the team's queued jobs ask for in total.",
                sum(n for n, _ in jobs), team=team)
        exp.add("trainyard_team_queue_oldest_wait_seconds", "gauge",
                "How long the team's longest-waiting queued job has waited.",
                max(w for _, w in jobs) if jobs else None, team=team)
        exp.add("trainyard_team_queue_mean_wait_seconds", "gauge", "Mean wait so far of the team's queued jobs.",
                sum(w for _, w in jobs) / len(jobs) if jobs else None, team=team)


def collect_processes(exp: Exposition) -> None:
    """Liveness of every process (jobs/fleet/liveness.py), and what `make run`'s supervisor adds."""
    for row in liveness.processes():
        exp.add("trainyard_process_up", "gauge", "1 if the process proved alive within its stamp TTL (web, redis, "
                "control, notify, beat, relay; agent:<node> by heartbeat), else 0.", row["up"], process=row["process"])
        exp.add("trainyard_process_heartbeat_age_seconds", "gauge",
                "Seconds since the process's last liveness stamp or heartbeat.", row["age_s"], process=row["process"])
    sup = liveness.supervisor()
    exp.add("trainyard_supervisor_up", "gauge", "1 while make run's supervisor keeps its status file fresh "
            "(no sample: no supervisor on this host).", None if sup is None else sup["up"])
    for name, p in (sup or {}).get("processes", {}).items():
        exp.add("trainyard_process_running", "gauge", "1 if the supervisor's child runs now (0: waiting out its "
                "restart backoff).", bool(p.get("running")), process=name)
        exp.add("trainyard_process_restarts_total", "counter", "Restarts by the supervisor since it started.",
                int(p.get("restarts") or 0), process=name)


def render() -> str:
    exp = Exposition()
    collect_jobs(exp)
    collect_team_queue(exp)
    collect_nodes(exp)
    collect_control_clock(exp)
    collect_security(exp)
    collect_relay(exp)
    collect_relay_pending(exp)
    collect_scheduler(exp)
    collect_processes(exp)
    return exp.render()


def _denied(status: int) -> HttpResponse:
    resp = HttpResponse("authentication required\n" if status == 401 else "staff only\n", status=status,
                        content_type="text/plain; charset=utf-8")
    if status == 401:
        resp["WWW-Authenticate"] = 'Bearer realm="trainyard-metrics"'
    return resp


def access(request) -> int:
    """200 if the request may scrape, else the status to refuse it with."""
    header = request.headers.get("Authorization", "")
    if header[:7].lower() == "bearer ":
        expected = os.environ.get(TOKEN_ENV) or getattr(settings, TOKEN_ENV, "") or ""
        given = header[7:].strip()
        if expected and hmac.compare_digest(given.encode(), expected.encode()):
            return 200
        return 401
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return 401
    return 200 if user.is_staff else 403


def metrics_view(request):
    if request.method not in ("GET", "HEAD"):
        resp = HttpResponse(status=405)
        resp["Allow"] = "GET, HEAD"
        return resp
    status = access(request)
    if status != 200:
        return _denied(status)
    return HttpResponse(render(), content_type=CONTENT_TYPE)
