"""Job list benchmark (issue 25 section 3): the page (/jobs/) and the API (GET /api/v1/jobs/) over
10,000 jobs, a page at a time, filtered, searched and sorted. Prints one JSON object on stdout
(progress on stderr).

    python bench/joblist.py               # ~2-4 min on 2 shared cores
    python bench/joblist.py --quick       # 2,000 jobs, fewer repeats (~40 s)
    python bench/joblist.py --jobs 20000 --repeat 25
    python bench/joblist.py --postgres    # the same on a PostgreSQL server started for the run

A fresh SQLite database in a temporary directory (WAL, as `make run`), migrated by `migrate`, then
bulk-created: `--jobs` jobs over 90 days from 12 users in 4 teams (the stored spec of a real
submit, ~2 KB of JSON each), 8 nodes, an attempt with its allocations (1-2 nodes) for every job
that started, 5 steps x ranks of samples for the running ones, 0-3 tags each from 30 (one common
tag on ~30% of jobs, one rare on ~0.2%), statuses as on a busy cluster (the newest 600: 40% queued,
40% running; every older job ended: 75% succeeded, 15% failed, 10% cancelled).

Each case is one URL fetched through Django's test Client (the whole stack: middleware, session,
the view or DRF, the template or serializer) as `alice` (no staff: her own and her team's jobs,
~1/3 of them) and as staff (every job), first, middle and last page where the case pages. Cases
are fetched round-robin, `--repeat` times each after one warm-up, so drift on a shared machine
spreads over all of them. Per case: p50/p95 ms, the SQL queries per request, and `ratio_p50` to
the baseline measured in the same rounds: the unfiltered first page of the same surface and user
(what /jobs/ showed before, without paging). `old_newest_200_ms` is the list this one replaced
(the newest 200 with DISTINCT and per-row throughput, no filters), timed as a query beside it;
`queue_positions_ms` the scheduler's queue order that a page with queued jobs on it pays (the
old list paid it on every load), also beside it.

Target: every case's p50 < 200 ms (`targets_met`, `p50_over_target` names the others; p95 is
reported, but on a shared 2-core machine it measures the neighbours: `loadavg_1min` says how busy
the machine was before and after).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TARGET_MS = 200.0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def setup_django(tmp: Path, database_url: str | None = None) -> None:
    os.environ["TRAINYARD_VAR_DIR"] = str(tmp)
    os.environ["TRAINYARD_DB"] = str(tmp / "bench.sqlite3")
    os.environ.pop("DATABASE_URL", None)
    if database_url:
        os.environ["DATABASE_URL"] = database_url
    os.environ["TRAINYARD_THROTTLE_USER"] = "100000000/min"  # the bench is one user asking fast, on purpose
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    import django

    django.setup()
    from django.core.management import call_command
    from django.test.utils import setup_test_environment

    setup_test_environment()  # "testserver" allowed, as the test Client needs
    call_command("migrate", verbosity=0)


def populate(n_jobs: int, seed: int) -> dict:
    from django.contrib.auth.models import Group, User
    from django.utils import timezone

    from jobs.models import Allocation, Attempt, Job, JobTag, MetricSample, Node
    from trainyard.spec import parse_job_spec

    rng = random.Random(seed)
    teams = [Group.objects.create(name=t) for t in ("vision", "nlp", "speech", "rl")]
    users = []
    for i in range(12):
        u = User.objects.create_user(["alice", "bob", "carol", "dan", "erin", "frank", "grace", "heidi", "ivan",
                                      "judy", "mallory", "niaj"][i], password="x")
        u.groups.add(teams[i % 4])
        users.append(u)
    staff = User.objects.create_user("root", password="x", is_staff=True)
    nodes = [Node.objects.create(name=f"node-{c}", address=f"127.0.0.{i + 1}", slots=8)
             for i, c in enumerate("abcdefgh")]
    vocab = [f"sweep-{i}" for i in range(12)] + [f"v{i}" for i in range(8)] + \
            ["baseline", "ablation", "long", "debug", "fp16", "powersgd", "paper", "prod", "rare-tag", "common"]
    base = parse_job_spec({"name": "x"}).to_json()
    words = ["gpt", "mlp", "lr", "warmup", "sweep", "baseline", "ablation", "tp2", "pp2", "big", "tiny"]
    now = timezone.now()
    ended = [Job.Status.SUCCEEDED] * 75 + [Job.Status.FAILED] * 15 + [Job.Status.CANCELLED] * 10
    recent = [Job.Status.QUEUED] * 4 + [Job.Status.RUNNING] * 4 + [Job.Status.SUCCEEDED] * 2
    n_recent = min(600, n_jobs // 10)  # a busy cluster: ~250 queued and ~250 running among the newest
    created = Job._meta.get_field("created_at")
    created.auto_now_add = False  # the bench spreads submit times over 90 days
    jobs = []
    for i in range(n_jobs):
        owner = users[rng.randrange(len(users))]
        status = rng.choice(recent if i >= n_jobs - n_recent else ended)
        at = now - timedelta(seconds=(n_jobs - i) * 90 * 86400 / n_jobs)
        started = None if status == Job.Status.QUEUED else at + timedelta(seconds=rng.randint(1, 3600))
        finished = started + timedelta(seconds=rng.randint(60, 86400)) if status in Job.TERMINAL else None
        steps = rng.choice([200, 1000, 5000])
        spec = {**base, "name": f"{rng.choice(words)}-{rng.choice(words)}-{i}", "train": {**base["train"], "steps": steps}}
        jobs.append(Job(name=spec["name"], owner=owner, team=owner.groups.first(), spec=spec,
                        plan={"dp": 2, "source": "spec"}, status=status, slots=2, created_at=at, started_at=started,
                        finished_at=finished, step=steps if status == Job.Status.SUCCEEDED else rng.randint(0, steps),
                        priority=1))
    Job.objects.bulk_create(jobs, batch_size=1000)
    created.auto_now_add = True
    jobs = list(Job.objects.order_by("id"))
    tags = []
    for j in jobs:
        names = set(rng.sample(vocab[:-2], rng.choice([0, 0, 1, 1, 2, 3])))
        if rng.random() < 0.3:
            names.add("common")
        if rng.random() < 0.002:
            names.add("rare-tag")
        tags += [JobTag(job=j, name=t) for t in names]
    JobTag.objects.bulk_create(tags, batch_size=2000)
    attempts = [Attempt(job=j, number=1, status=(Attempt.Status.RUNNING if j.status == Job.Status.RUNNING
                                                  else Attempt.Status.ENDED), started_at=j.started_at,
                        ended_at=j.finished_at) for j in jobs if j.started_at is not None]
    Attempt.objects.bulk_create(attempts, batch_size=1000)
    attempts = list(Attempt.objects.select_related("job").order_by("id"))
    allocs, samples = [], []
    for a in attempts:
        picked = rng.sample(nodes, rng.choice([1, 2]))
        allocs += [Allocation(attempt=a, node=n, node_rank=k, slot_ids=[0], active=a.status != Attempt.Status.ENDED)
                   for k, n in enumerate(picked)]
        if a.status == Attempt.Status.RUNNING:
            samples += [MetricSample(job=a.job, attempt=a, rank=r, step=s, ts=time.time(), loss=2.0,
                                     samples_per_s=400.0 + r, step_s=0.04) for s in range(5) for r in range(2)]
    Allocation.objects.bulk_create(allocs, batch_size=2000)
    MetricSample.objects.bulk_create(samples, batch_size=2000)
    from django.db import connection

    from jobs.telemetry import rollup

    with connection.cursor() as cur:  # the per-step rows the list's throughput reads (issue 26)
        cur.execute(rollup.backfill_sql(connection.vendor))
    return {"users": {"alice": users[0], "staff": staff}, "jobs": len(jobs), "tags": len(tags),
            "attempts": len(attempts), "allocations": len(allocs), "samples": len(samples)}


def cases() -> list[tuple[str, str]]:
    """(name, query string) per case; {mid} and {last} are the case's own middle and last page (its
    filtered count for the user), {since} and {until} a 10-day window a month ago."""
    return [
        ("unfiltered_first", ""),
        ("unfiltered_middle", "page={mid}"),
        ("unfiltered_last", "page={last}"),
        ("status_succeeded_middle", "status=SUCCEEDED&page={mid}"),
        ("status_queued_running", "status=QUEUED,RUNNING"),
        ("tag_common", "tag=common"),
        ("tag_common_last", "tag=common&page={last}"),
        ("tag_rare", "tag=rare-tag"),
        ("two_tags", "tag=common&tag=baseline"),
        ("owner", "owner=alice"),
        ("team", "team=vision"),
        ("node", "node=node-c"),
        ("search", "q=sweep"),
        ("date_range", "since={since}&until={until}"),
        ("sort_name", "ordering=name"),
        ("sort_steps_desc_middle", "ordering=-steps&page={mid}"),
        ("sort_started_last", "ordering=started&page={last}"),
        ("sort_finished_desc", "ordering=-finished"),
        ("sort_owner", "ordering=owner"),
        ("combined", "status=SUCCEEDED&tag=common&node=node-c&q=gpt&ordering=-submitted"),
        ("page_size_200", "page_size=200"),
    ]


def percentile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * p
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def old_newest_200(user) -> float:
    """The list this one replaced, as a query: jobs_visible_to with its DISTINCT, newest 200, with
    per-row throughput (the view's `_with_throughput`), fetched whole."""
    from django.db.models import Q

    from jobs.models import Job
    from jobs.runs.views import _with_throughput

    qs = Job.objects.select_related("owner")
    if not user.is_staff:
        qs = qs.filter(Q(owner=user) | Q(team__in=user.groups.all())).distinct()
    t0 = time.perf_counter()
    list(_with_throughput(qs).order_by("-id")[:200])
    return (time.perf_counter() - t0) * 1000


def build_urls(users: dict) -> tuple[list[tuple[str, str, str, str]], dict]:
    """Every (user, surface, case, url) and a logged-in Client per user."""
    from django.http import QueryDict
    from django.test import Client
    from django.utils import timezone

    from jobs.runs.selectors import job_query, jobs_listed

    now = timezone.now()
    since, until = (now - timedelta(days=40)).date().isoformat(), (now - timedelta(days=30)).date().isoformat()
    urls, clients = [], {}
    for who, user in users.items():
        clients[who] = Client()
        clients[who].force_login(user)
        for surface, path, size in (("page", "/jobs/", 50), ("api", "/api/v1/jobs/", 50)):
            for name, q in cases():
                filters = QueryDict(re.sub(r"(^|&)page=[^&]*", "", q).format(since=since, until=until))
                last = max(1, -(-jobs_listed(user, job_query(filters)).count() // size))
                q = q.format(mid=max(1, (last + 1) // 2), last=last, since=since, until=until)
                urls.append((who, surface, name, f"{path}?{q}" if q else path))
    return urls, clients


def measure(urls, clients, users: dict, repeat: int) -> dict:
    """Round-robin over the cases (round 0 warms up): ms per request, queries per request, and
    beside them the old list's query and the scheduler's queue positions."""
    from django.db import connection, reset_queries
    from django.test.utils import CaptureQueriesContext

    from jobs.scheduling.selectors import queue_positions

    got = {"samples": {u[:3]: [] for u in urls}, "queries": {}, "old": {who: [] for who in users}, "positions": []}
    for round_ in range(repeat + 1):
        for who, surface, name, url in urls:
            reset_queries()
            with CaptureQueriesContext(connection) as ctx:
                t = time.perf_counter()
                resp = clients[who].get(url)
                ms = (time.perf_counter() - t) * 1000
            if resp.status_code != 200:
                raise SystemExit(f"{url} as {who}: HTTP {resp.status_code}: {resp.content[:300]!r}")
            if round_:
                got["samples"][(who, surface, name)].append(ms)
            got["queries"][(who, surface, name)] = len(ctx.captured_queries)
        for who, user in users.items():
            ms = old_newest_200(user)
            if round_:
                got["old"][who].append(ms)
        t = time.perf_counter()
        queue_positions()
        if round_:
            got["positions"].append((time.perf_counter() - t) * 1000)
        log(f"round {round_}/{repeat} done")
    return got


def summarize(urls, got: dict, users: dict) -> dict:
    from jobs.access.selectors import jobs_visible_to

    out: dict = {"results": {}}
    over = []
    for who in users:
        out["results"][who] = {"visible_jobs": jobs_visible_to(users[who]).count(),
                               "old_newest_200_ms": round(statistics.median(got["old"][who]), 1)}
        for surface in ("page", "api"):
            base = statistics.median(got["samples"][(who, surface, "unfiltered_first")])
            rows = {}
            for (w, s, name, url) in urls:
                if (w, s) != (who, surface):
                    continue
                xs = got["samples"][(w, s, name)]
                p50, p95 = statistics.median(xs), percentile(xs, 0.95)
                if p50 >= TARGET_MS:
                    over.append(f"{who}/{surface}/{name}")
                rows[name] = {"p50_ms": round(p50, 1), "p95_ms": round(p95, 1), "ratio_p50": round(p50 / base, 2),
                              "queries": got["queries"][(w, s, name)], "url": url}
            out["results"][who][surface] = rows
    every = [r for who in users for s in ("page", "api") for r in out["results"][who][s].values()]
    out["queue_positions_ms"] = round(statistics.median(got["positions"]), 1)
    out["worst_p50_ms"] = max(r["p50_ms"] for r in every)
    out["worst_p95_ms"] = max(r["p95_ms"] for r in every)
    out["p50_over_target"] = over
    out["targets_met"] = not over
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="2,000 jobs, 5 repeats")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (the database)")
    ap.add_argument("--postgres", action="store_true", help="on a PostgreSQL server started for the run "
                    "(Debian's postgresql, as `make test-postgres`) instead of SQLite")
    args = ap.parse_args()
    if args.quick:
        args.jobs, args.repeat = 2000, 5
    tmp = Path(tempfile.mkdtemp(prefix="trainyard-joblist-"))
    pg = None
    try:
        if args.postgres:  # Debian's PostgreSQL in the temporary directory, as `make test-postgres` runs it
            from tests.postgres import PostgresServer

            pg = PostgresServer().start()  # its own directory under /tmp (the server runs as nobody)
        setup_django(tmp, pg.create_database("joblist") if pg else None)
        from django.db import connection

        from jobs.models import Job

        t0 = time.perf_counter()
        made = populate(args.jobs, args.seed)
        log(f"populated in {time.perf_counter() - t0:.1f} s: {made['jobs']} jobs, {made['tags']} tags, "
            f"{made['attempts']} attempts, {made['allocations']} allocations")
        with connection.cursor() as c:
            c.execute("ANALYZE")  # what a long-lived database has (the planners' statistics)
        urls, clients = build_urls(made["users"])
        load_before = os.getloadavg()[0]
        got = measure(urls, clients, made["users"], args.repeat)
        out = {"jobs": made["jobs"], "tags": made["tags"], "attempts": made["attempts"],
               "allocations": made["allocations"], "repeat": args.repeat, "target_ms": TARGET_MS,
               "database": connection.vendor,
               "status_counts": {s: Job.objects.filter(status=s).count() for s in Job.Status.values},
               # other work on the machine (a shared 2-core box): every figure scales with it
               "loadavg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)], "cpus": os.cpu_count(),
               **summarize(urls, got, made["users"])}
        print(json.dumps(out, indent=1))
    finally:
        if pg is not None:
            from django.db import connections

            connections.close_all()
            pg.stop(keep_data=args.keep)
        if args.keep:
            log(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
