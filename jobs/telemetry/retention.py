"""Telemetry retention (issue 26): the periodic purge (control beat, TRAINYARD_TELEMETRY_PURGE_S;
`manage.py purge_telemetry [--dry-run]`) and the settings it reads (RetentionPolicy: the site's row,
team empty, created with DEFAULTS on first use, and optionally one per team whose set fields
override the site's, field by field).

Per job, the per-rank MetricSample rows are kept
- in full for the recent window: steps > Job.step - rank_window_steps (Job.step is the job's top
  step, rewound to the resume point when a new attempt starts, so an abandoned attempt's later
  steps stay until the job is past them again);
- beyond it, thinned to the steps that are multiples of `thinning_stride(...)`: the smallest power of
  two k with ceil(span / k) <= rank_sampled_per_rank, span the number of steps beyond the window
  (between N/2 and N steps per rank stay). A power of two, so a longer job's stride is a multiple of
  every earlier one: repeated purges only ever drop more of the same grid, never pick other steps;
- in full within EVENT_NEIGHBOURHOOD_STEPS of what matters: a straggler flagged (its since_step), a
  restart, a shrink, a resume, a rollback or continue (their steps), and every attempt's resume point
  (which is also where a resize happens: elastic_started's new attempt).
MetricStep (the per-step reductions) is never thinned.

After a job ends (terminal, finished_at set): its per-rank rows go after rank_days, its MetricStep
rows after reduced_days, its kept log files (jobs/telemetry/keptlogs.py) after logs_days, and the job
itself (attempts, events, checkpoints and their files, kept logs) after finished_jobs_days. Empty
days: forever.

Never in the relay's way: every delete is at most BATCH_ROWS rows by primary key (ids picked by
reads outside any transaction, or a bounded subquery), in its own short transaction; on SQLite, where
the relay's round needs the one write lock (BEGIN IMMEDIATE), each batch is followed by a pause at
least as long as the batch itself (and SQLITE_YIELD_MIN_S), so a waiting round gets the lock in the
gap. A run stops at its time budget and the next one goes on from there.

Replays: the rollup reduces a sample only when its (attempt, rank, step) row is not stored yet, so a
replay of a sample whose row was already purged would be reduced twice; the relay only replays its
unacknowledged entries (seconds old), always inside the recent window.
"""
from __future__ import annotations

import bisect
import logging
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.core.cache import cache
from django.db import connection, transaction
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from trainyard import keys, safefs

from jobs.models import Attempt, Job, JobEvent, MetricSample, MetricStep
from jobs.telemetry import keptlogs
# the settings (DEFAULTS, effective, site_row: also what tests and bench/storage.py read through here)
from jobs.telemetry.retention_settings import DEFAULTS, Policy, effective, policies, site_row  # noqa: F401

log = logging.getLogger(__name__)

EVENT_NEIGHBOURHOOD_STEPS = 50
"""Per-rank rows kept in full this many steps either side of an event's step (EVENT_STEP_KEYS)."""
EVENT_STEP_KEYS = {"straggler": "since_step", "restart": "resume_step", "shrinking": "resume_step",
                   "resumed": "step", "rollback": "step", "continued": "step"}
"""JobEvent kinds whose neighbourhood is kept, and the key of their data holding the step."""

BATCH_ROWS = 5000
"""The most rows one delete (one transaction) removes."""
BATCH_TARGET_S = 0.05
"""Batches start at BATCH_START_ROWS and are sized to take about this long (at most BATCH_ROWS rows):
the longest a relay round waits on SQLite's write lock for the purge."""
BATCH_START_ROWS = 1000
WINDOW_ROWS = 100_000
"""Thinning reads the ids of about this many rows (a window of steps across every rank) at a time."""
SQLITE_YIELD_MIN_S = 0.02
"""SQLite: the least pause after each batch, so a relay round waiting on the write lock gets it."""
WATERMARK_TTL_S = 3600
"""How long a job's thinning watermark (the steps already thinned) is trusted: rows that arrive late
below it (a rank far behind) are thinned by the next full pass, at the latest this much later."""


@dataclass
class PurgeResult:
    dry_run: bool = False
    rank_rows_thinned: int = 0  # beyond the window, off the grid and off every event's neighbourhood
    rank_rows_expired: int = 0  # rank_days after the job ended
    step_rows_expired: int = 0  # reduced_days after the job ended
    logs_removed: list[int] = field(default_factory=list)  # jobs whose kept logs went (logs_days)
    log_bytes_removed: int = 0
    jobs_deleted: list[int] = field(default_factory=list)  # finished_jobs_days
    jobs_thinned: list[int] = field(default_factory=list)
    batches: int = 0
    max_batch_s: float = 0.0
    seconds: float = 0.0
    complete: bool = True  # False: the time budget ran out, the next run goes on

    def as_dict(self) -> dict:
        return asdict(self)


# --- thinning ------------------------------------------------------------------------------------

def thinning_stride(top: int, window: int, per_rank: int) -> int | None:
    """k: beyond the window (steps 0 .. top - window) the rows at steps % k == 0 stay. The smallest
    power of two with ceil(span / k) <= per_rank; 1 (all stay) for a span that fits; None (none
    stay) when per_rank is 0."""
    span = top - window + 1
    if span <= 0:
        return 1
    if per_rank <= 0:
        return None
    k = 1
    while -(-span // k) > per_rank:
        k *= 2
    return k


def event_steps(job_id: int) -> list[int]:
    """The steps whose neighbourhood stays in full: EVENT_STEP_KEYS' events and every attempt's
    resume point (restarts, preemptions, resizes)."""
    steps = set()
    for kind, data in JobEvent.objects.filter(job_id=job_id, kind__in=EVENT_STEP_KEYS).values_list("kind", "data"):
        step = (data or {}).get(EVENT_STEP_KEYS[kind])
        if type(step) is int and step >= 0:
            steps.add(step)
    steps.update(Attempt.objects.filter(job_id=job_id, resumed_from_step__isnull=False)
                 .values_list("resumed_from_step", flat=True))
    return sorted(steps)


def neighbourhoods(steps: list[int], radius: int = EVENT_NEIGHBOURHOOD_STEPS) -> list[tuple[int, int]]:
    """The merged [a, b] step intervals within `radius` of `steps` (sorted)."""
    out: list[list[int]] = []
    for s in sorted(steps):
        a, b = max(0, s - radius), s + radius
        if out and a <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def kept_steps_rule(top: int, policy: Policy, marks: list[tuple[int, int]]):
    """The rule as a predicate step -> kept (for tests and the benchmark; the purge applies the same)."""
    hi = top - policy.rank_window_steps + 1
    k = thinning_stride(top, policy.rank_window_steps, policy.rank_sampled_per_rank)
    starts = [a for a, _ in marks]

    def kept(step: int) -> bool:
        if step >= hi or (k is not None and step % k == 0):
            return True
        i = bisect.bisect_right(starts, step) - 1
        return i >= 0 and step <= marks[i][1]
    return kept


def _qn(name: str) -> str:
    return connection.ops.quote_name(name)


class _Purger:
    def __init__(self, result: PurgeResult, deadline: float):
        self.result = result
        self.deadline = deadline
        self.sqlite = connection.vendor == "sqlite"
        self.batch = min(BATCH_START_ROWS, BATCH_ROWS)

    def out_of_time(self) -> bool:
        if time.monotonic() >= self.deadline:
            self.result.complete = False
            return True
        return False

    def _batch_done(self, t0: float) -> None:
        took = time.monotonic() - t0
        self.result.batches += 1
        self.result.max_batch_s = max(self.result.max_batch_s, took)
        # the next batch sized to take about BATCH_TARGET_S (never more than doubling, never over BATCH_ROWS)
        self.batch = max(10, min(BATCH_ROWS, 2 * self.batch, int(self.batch * BATCH_TARGET_S / max(took, 1e-4))))
        if self.sqlite:  # the relay's round may be waiting on the write lock: leave it a gap
            time.sleep(max(SQLITE_YIELD_MIN_S, took))

    def delete_ids(self, table: str, ids: list[int]) -> int:
        if self.result.dry_run:
            return len(ids)
        done, i = 0, 0
        while i < len(ids):
            chunk = ids[i:i + self.batch]
            i += len(chunk)
            t0 = time.monotonic()
            with transaction.atomic(), connection.cursor() as cur:
                cur.execute(f"DELETE FROM {_qn(table)} WHERE {_qn('id')} IN ({', '.join(['%s'] * len(chunk))})",
                            chunk)
                done += cur.rowcount
            self._batch_done(t0)
        return done

    def delete_job_rows(self, model, job_id: int) -> int:
        """Every row of `model` of the job, at most BATCH_ROWS at a time (a bounded subquery per transaction;
        no ORDER BY: PostgreSQL would sort all of the job's rows for every batch)."""
        if self.result.dry_run:
            return model.objects.filter(job_id=job_id).count()
        table, done = _qn(model._meta.db_table), 0
        while not self.out_of_time():
            t0, limit = time.monotonic(), self.batch
            with transaction.atomic(), connection.cursor() as cur:
                cur.execute(f"DELETE FROM {table} WHERE {_qn('id')} IN (SELECT {_qn('id')} FROM {table} "
                            f"WHERE {_qn('job_id')} = %s LIMIT {int(limit)})", [job_id])
                n = cur.rowcount
            done += n
            self._batch_done(t0)
            if n < limit:
                break
        return done

    # the thinning of one job
    def thin(self, job_id: int, top: int, policy: Policy) -> None:
        window = policy.rank_window_steps
        hi = top - window + 1  # steps below hi are beyond the window
        k = thinning_stride(top, window, policy.rank_sampled_per_rank)
        if hi <= 0 or k == 1:
            return
        latest_attempt = Attempt.objects.filter(job_id=job_id).order_by("-pk").values_list("pk", flat=True).first()
        latest_event = JobEvent.objects.filter(job_id=job_id).order_by("-pk").values_list("pk", flat=True).first()
        key = f"trainyard:retention:thinned:{job_id}"
        basis = (k, latest_attempt, latest_event)  # events and attempts only ever come: their newest ids say all
        mark = cache.get(key)
        # the watermark: steps below mark[1] were thinned with the same stride, attempts and events
        lo = mark[1] if mark and mark[0] == basis and mark[1] <= hi else 0
        if lo >= hi:
            return
        marks = neighbourhoods(event_steps(job_id))
        starts = [a for a, _ in marks]

        def kept(step: int) -> bool:
            i = bisect.bisect_right(starts, step) - 1
            return i >= 0 and step <= marks[i][1]

        table = _qn(MetricSample._meta.db_table)
        off_grid = f" AND ({_qn('step')} %% {k}) <> 0" if k is not None else ""
        span = (f"SELECT {_qn('id')}, {_qn('step')} FROM {table} WHERE {_qn('job_id')} = %s AND {_qn('rank')} = %s "
                f"AND {_qn('step')} >= %s AND {_qn('step')} < %s{off_grid}")
        next_rank = f"SELECT MIN({_qn('rank')}) FROM {table} WHERE {_qn('job_id')} = %s AND {_qn('rank')} > %s"
        ranks: list[int] = []
        with connection.cursor() as cur:  # the ranks, one index seek each
            while True:
                cur.execute(next_rank, [job_id, ranks[-1] if ranks else -1])
                rank = cur.fetchone()[0]
                if rank is None:
                    break
                ranks.append(rank)
        # Step windows across every rank, the ids of each sorted: the relay writes step-major, so a
        # window's rows sit together in the table (and in the FK indexes); rank by rank they would
        # be a table page each.
        width = max(1, WINDOW_ROWS // max(1, len(ranks)))
        deleted, a = 0, lo
        while ranks and a < hi and not self.out_of_time():
            b = min(hi, a + width)
            doomed: list[int] = []
            seen = 0
            with connection.cursor() as cur:
                for rank in ranks:
                    cur.execute(span, [job_id, rank, a, b])
                    rows = cur.fetchall()
                    seen += len(rows)
                    doomed.extend(i for i, step in rows if not kept(step))
            doomed.sort()
            deleted += self.delete_ids(MetricSample._meta.db_table, doomed)
            # the next window: about WINDOW_ROWS rows at this one's density (wide where already thinned)
            width = max(1, int(WINDOW_ROWS * (b - a) / seen)) if seen else 8 * (b - a)
            a = b
            if not self.result.dry_run:  # steps below `a` are done, whatever stops this run
                cache.set(key, (basis, a), WATERMARK_TTL_S)
        self.result.rank_rows_thinned += deleted
        if deleted:
            self.result.jobs_thinned.append(job_id)

    def delete_job(self, job: Job) -> None:
        """The job and everything of it: per-rank and per-step rows in batches first (a cascade would
        take them in one long transaction), then the rest with the row, and after commit its
        checkpoint directory (and its kept logs: jobs/signals.py)."""
        self.result.rank_rows_expired += self.delete_job_rows(MetricSample, job.pk)
        self.result.step_rows_expired += self.delete_job_rows(MetricStep, job.pk)
        if self.result.complete:
            self.result.jobs_deleted.append(job.pk)
        if self.result.dry_run or not self.result.complete:
            return
        root, rel = Path(settings.TRAINYARD_CHECKPOINT_ROOT).resolve(), keys.job_checkpoint_dir(Path("."), job.pk)
        with transaction.atomic():
            job.delete()
            transaction.on_commit(lambda: _remove_quietly(root, rel))


def _remove_quietly(root: Path, rel: Path) -> None:
    try:
        safefs.remove_beneath(root, rel)
    except OSError as exc:
        log.warning("retention: cannot remove %s under %s: %s", rel, root, exc)


def _ended(field_name: str, site: Policy, teams: dict[int, Policy], now) -> Q | None:
    """Finished jobs past `field_name` days after their end (per their team's settings), or None."""
    q = Q(pk__in=[])
    any_cut = False
    overridden = [t for t, p in teams.items() if getattr(p, field_name) != getattr(site, field_name)]
    for team_id in overridden:
        days = getattr(teams[team_id], field_name)
        if days is not None:
            q |= Q(team_id=team_id, finished_at__lt=now - timedelta(days=days))
            any_cut = True
    days = getattr(site, field_name)
    if days is not None:
        q |= Q(finished_at__lt=now - timedelta(days=days)) & ~Q(team_id__in=overridden)
        any_cut = True
    return q if any_cut else None


def _finished_jobs():
    return Job.objects.filter(status__in=Job.TERMINAL, finished_at__isnull=False)


def _log_dir_exists(root, job_id: int) -> bool:
    try:
        return (Path(root) / keys.job_log_relpath(job_id)).exists()
    except OSError:
        return False


def telemetry_purge(*, dry_run: bool = False, now=None, budget_s: float | None = None) -> PurgeResult:
    """Apply the retention settings to every job (module docstring). dry_run: count what would go,
    delete nothing. budget_s: stop after about this long (default TRAINYARD_TELEMETRY_PURGE_BUDGET_S)."""
    started = time.monotonic()
    now = now or timezone.now()
    budget = settings.TRAINYARD_TELEMETRY_PURGE_BUDGET_S if budget_s is None else budget_s
    result = PurgeResult(dry_run=dry_run)
    p = _Purger(result, started + budget)
    site, teams = policies()

    # 1. finished jobs past finished_jobs_days: gone altogether
    q = _ended("finished_jobs_days", site, teams, now)
    if q is not None:
        for job in _finished_jobs().filter(q).order_by("finished_at", "pk"):
            if p.out_of_time():
                break
            p.delete_job(job)
    # 2. the rest of what ended long enough ago: per-rank rows, per-step rows, kept logs
    for field_name, model, counter in (("rank_days", MetricSample, "rank_rows_expired"),
                                       ("reduced_days", MetricStep, "step_rows_expired")):
        q = _ended(field_name, site, teams, now)
        if q is None:
            continue
        has_rows = Exists(model.objects.filter(job_id=OuterRef("pk")))
        for job_id in _finished_jobs().filter(q).filter(has_rows).exclude(pk__in=result.jobs_deleted).order_by(
                "finished_at", "pk").values_list("pk", flat=True):
            if p.out_of_time():
                break
            setattr(result, counter, getattr(result, counter) + p.delete_job_rows(model, job_id))
    q = _ended("logs_days", site, teams, now)
    if q is not None:
        root = settings.TRAINYARD_KEPT_LOG_ROOT
        for job_id in _finished_jobs().filter(q).exclude(pk__in=result.jobs_deleted).order_by(
                "finished_at", "pk").values_list("pk", flat=True):
            if p.out_of_time():
                break
            if not _log_dir_exists(root, job_id):
                continue
            result.log_bytes_removed += sum(f.size for f in keptlogs.kept_files(root, job_id))
            result.logs_removed.append(job_id)
            if not dry_run:
                keptlogs.remove_job(root, job_id)
    # 3. thinning: every job past its window that still has per-rank rows
    least_window = min([site.rank_window_steps, *(t.rank_window_steps for t in teams.values())])
    for job_id, top, team_id in Job.objects.filter(step__gt=least_window).exclude(pk__in=result.jobs_deleted).order_by(
            "-pk").values_list("pk", "step", "team_id"):
        if p.out_of_time():
            break
        p.thin(job_id, top, teams.get(team_id, site))
    result.seconds = round(time.monotonic() - started, 3)
    result.max_batch_s = round(result.max_batch_s, 4)
    if result.rank_rows_thinned or result.rank_rows_expired or result.step_rows_expired or result.jobs_deleted \
            or result.logs_removed:
        log.info("telemetry purge%s: %s", " (dry run)" if dry_run else "", result.as_dict())
    return result
