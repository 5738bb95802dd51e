"""The tick that keeps its expected ends current (issue 26 part 4: jobs/scheduling/policy/ends.py)
decides exactly what the tick before it did (bench/scheduler_reference.py, frozen, over the
placement before it, bench/placement_reference.py), and the start-time predictions that skip
passes that would change nothing predict what they did (bench/predict_reference.py), on random
cluster views that reach every path the ends feed: reservations and their shadow times,
reclaim's "would it fit by the deadline" check before and after placements and preemptions,
in-flight preemptions, elastic starts on fewer nodes, grows and shrinks, avoided nodes, device
and label pools, gates, all three policies."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from jobs.scheduling.policy import ClusterView, NodeState, Quotas, QueuedJob, RunningJob, predict_starts, schedule

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "bench"))
from predict_reference import reference_predict_starts  # noqa: E402
from scheduler_reference import reference_schedule  # noqa: E402

NOW = 50_000.0
TEAMS = ("a", "b", "c", None)


def _node(rng: random.Random, i: int) -> dict:
    slots = rng.choice([1, 2, 4, 4, 8, 8])
    cuda = rng.random() < 0.25
    return dict(name=f"n{i:02d}", slots=slots, ok=rng.random() < 0.92, rack=rng.choice(["r1", "r2", "r3", None]),
                device="cuda" if cuda else "cpu", gpus=rng.choice([slots, slots, max(1, slots // 2)]) if cuda else 0,
                mem=rng.choice([16e9, 40e9, 80e9]) if cuda else 0,
                labels=(("zone", rng.choice("xy")),) if rng.random() < 0.3 else ())


def _queued(rng: random.Random, jid: int, names: list[str]) -> QueuedJob:
    nodes = rng.choice([1, 1, 1, 2, 2, 3, 4])
    elastic = nodes > 1 and rng.random() < 0.25
    restricted = rng.random() < 0.15
    return QueuedJob(
        jid, rng.randint(0, 2), nodes, rng.choice([1, 1, 2, 2, 4, 8]),
        frozenset(rng.sample(names, rng.randint(1, 2))) if rng.random() < 0.1 else frozenset(),
        rng.choice(TEAMS), f"u{rng.randrange(5)}", NOW - rng.uniform(0, 5000),
        rng.choice([rng.uniform(5, 500), rng.uniform(300, 20_000), 3600.0]),
        device="cuda" if restricted and rng.random() < 0.6 else "cpu",
        gpu_memory_bytes=int(rng.choice([0, 20e9, 60e9])) if restricted else 0,
        labels=(("zone", rng.choice("xy")),) if restricted and rng.random() < 0.5 else (),
        min_nodes=rng.randint(1, nodes - 1) if elastic else None,
        restart_now=elastic and rng.random() < 0.2)


def _running(rng: random.Random, rid: int, shares: list, queue_ids: list[int]) -> RunningJob:
    slots = sum(len(ids) for _, ids in shares)
    inflight = queue_ids and rng.random() < 0.08
    stopping = inflight or rng.random() < 0.05
    elastic = None
    if len(shares) > 1 and rng.random() < 0.4 and len({len(ids) for _, ids in shares}) == 1:
        most = len(shares) + rng.randint(0, 2)
        elastic = QueuedJob(rid, 1, most, len(shares[0][1]), min_nodes=rng.randint(1, len(shares)),
                            submitted_at=NOW - rng.uniform(0, 9000))
    started = NOW - rng.uniform(10, 9000)
    return RunningJob(rid, rng.choice(TEAMS), f"u{rng.randrange(5)}", slots, rng.randint(0, 2), tuple(shares),
                      started, NOW + rng.choice([rng.uniform(-3000, 700), rng.uniform(0, 20_000)]),
                      not stopping, rng.choice(queue_ids) if inflight else None, elastic)


def random_view(rng: random.Random) -> ClusterView:
    specs = [_node(rng, i) for i in range(rng.randint(2, 14))]
    free = {s["name"]: list(range(s["slots"])) for s in specs}
    queue = [_queued(rng, j, list(free)) for j in range(1, rng.randint(2, 40))]
    running, rid = [], 1000
    for _ in range(rng.randint(0, 30)):
        width = rng.choice([1, 1, 1, 2, 3])
        per = rng.choice([1, 1, 2, 4])
        hosts = [n for n, ids in free.items() if len(ids) >= per]
        if len(hosts) < width:
            continue
        shares = []
        for name in sorted(rng.sample(hosts, width)):
            shares.append((name, tuple(free[name][:per])))
            del free[name][:per]
        running.append(_running(rng, rid, shares, [j.id for j in queue]))
        rid += 1
    nodes = tuple(NodeState(s["name"], f"10.0.0.{i}", s["slots"],
                            frozenset(set(range(s["slots"])) - set(free[s["name"]])), s["ok"], s["rack"],
                            s["device"], s["gpus"], int(s["mem"]), s["labels"]) for i, s in enumerate(specs))
    total = sum(s["slots"] for s in specs)
    quotas = Quotas({t: rng.randint(0, total // 2 + 1) for t in TEAMS[:3] if rng.random() < 0.9},
                    {f"u{i}": rng.randint(2, 16) for i in range(5) if rng.random() < 0.2},
                    frozenset(rng.sample(["a", "b", "user:u1"], rng.randint(0, 1))))
    return ClusterView(NOW, nodes, tuple(running), tuple(queue), quotas, {t: rng.uniform(0, 1e6) for t in "abc"},
                       rng.choice(["fifo", "backfill", "trainyard", "trainyard", "trainyard"]),
                       reclaim_wait_s=rng.choice([0.0, 600.0, 600.0, 4000.0]),
                       grow_min_left_s=rng.choice([0.0, 300.0]))


def test_the_tick_decides_what_the_reference_decided_on_random_views():
    rng = random.Random(26)
    seen = {"preemptions": 0, "reclaiming": 0, "eta": 0, "grow": 0, "shrink": 0, "fewer": 0, "placements": 0}
    for n in range(1500):
        view = random_view(rng)
        got, want = schedule(view), reference_schedule(view)
        assert got == want, f"view {n}: {view}"
        seen["preemptions"] += bool(got.preemptions)
        seen["placements"] += bool(got.placements)
        seen["reclaiming"] += any(w.startswith("reclaiming quota") for w in got.waiting.values())
        seen["eta"] += any("expected to start in" in w for w in got.waiting.values())
        seen["grow"] += any(p.for_job is None and p.resize_to for p in got.preemptions)
        seen["shrink"] += any(p.for_job is not None and p.resize_to for p in got.preemptions)
        seen["fewer"] += any(p.reason for p in got.placements)
    # the views reach the paths the expected ends feed (counts of views, out of 1,500)
    assert min(seen.values()) >= 10, seen


def test_the_predictions_are_the_references_on_random_views():
    rng = random.Random(27)
    predicted = 0
    for n in range(800):
        view = random_view(rng)
        got = predict_starts(view)
        assert got == reference_predict_starts(view), f"view {n}: {view}"
        assert predict_starts(view, depth=3) == reference_predict_starts(view, depth=3), f"view {n}: {view}"
        predicted += len(got)
    assert predicted > 5_000


@pytest.mark.parametrize("seed", [1])
def test_the_benchmark_cluster_gets_the_references_decisions_and_predictions(seed):
    """bench/scheduler.py's fill and busy views at 300 nodes / 3,000 queued jobs (the busy tick
    reserves for a head and checks reclaim for thousands of jobs): the same placements,
    preemptions, reasons and predicted starts."""
    import scheduler as bench

    fill, busy = bench.tick_views(300, 3000, seed)
    for view in (fill, busy):
        assert schedule(view) == reference_schedule(view)
    assert predict_starts(busy) == reference_predict_starts(busy)


def test_the_queue_order_is_the_references_with_ties_in_the_aged_key():
    """queue_order sorts a team's jobs by their aged key alone when no two are equal, else by
    (key, submitted_at, id): queues of batch submissions (equal times and predictions, some
    submitted after now) order as the reference orders them."""
    from order_reference import queue_order as reference_order

    from jobs.scheduling.policy import queue_order

    rng = random.Random(28)
    for n in range(300):
        view = random_view(rng)
        queue = tuple(QueuedJob(j.id, j.priority, j.nodes, j.procs_per_node, team=j.team, user=j.user,
                                submitted_at=NOW + rng.choice([-600.0, 0.0, 300.0]) if rng.random() < 0.7 else j.submitted_at,
                                predicted_s=rng.choice([600.0, 3600.0]) if rng.random() < 0.7 else j.predicted_s)
                      for j in view.queue)
        view = ClusterView(NOW, view.nodes, view.running, queue, view.quotas, view.usage)
        assert queue_order(view) == reference_order(view), f"view {n}: {view}"


def test_classify_is_the_ledgers_rule_in_start_order():
    """quotas.classify (QuotaLedger.take inlined; the references use the live one) borrows and
    counts what taking the running jobs one by one in (started_at, id) order does."""
    import dataclasses

    from jobs.scheduling.policy.quotas import QuotaLedger, classify

    rng = random.Random(29)
    for n in range(500):
        view = random_view(rng)
        running = [dataclasses.replace(r, started_at=float(round(r.started_at, -3))) for r in view.running]
        ledger = QuotaLedger(view.quotas.team_slots)
        want = {r.id for r in sorted(running, key=lambda r: (r.started_at, r.id))
                if r.preemptible and ledger.take(r.team, r.slots)}
        got, got_ledger = classify(running, view.quotas.team_slots)
        assert (got, got_ledger.within) == (want, ledger.within), f"view {n}: {view}"
