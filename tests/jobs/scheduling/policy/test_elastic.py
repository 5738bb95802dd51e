"""Elastic node counts in the scheduling policy (issue 24, section 2): start on fewer nodes when
that is predicted to finish sooner than waiting, grow onto free nodes nobody with a better claim
wants, restart at once after a resize or a lost node, and reclaim shrinking a borrowing elastic
job to its least nodes instead of stopping it. Pure policy."""
from jobs.scheduling.policy import ClusterView, NodeState, Quotas, QueuedJob, RunningJob, schedule


def node(name, used=(), slots=1):
    return NodeState(name, f"addr-{name}", slots, frozenset(used))


def ejob(id, lo, hi, predicted_s=1000.0, **kw):
    return QueuedJob(id, kw.pop("priority", 1), hi, 1, predicted_s=predicted_s, min_nodes=lo, **kw)


def running(id, nodes, end, *, team=None, slots=None, elastic=None, priority=1, started=0.0):
    return RunningJob(id, team, "u", slots or len(nodes), priority, tuple((n, (0,)) for n in nodes), started, end,
                      elastic=elastic)


def view(nodes, queue=(), run=(), now=0.0, **kw):
    return ClusterView(now, tuple(nodes), tuple(run), tuple(queue), **kw)


def test_takes_max_when_free():
    d = schedule(view([node("a"), node("b")], [ejob(1, 1, 2)]))
    assert [len(p.shares) for p in d.placements] == [2]
    assert d.placements[0].reason == ""


def test_starts_on_fewer_when_waiting_is_longer():
    # b is busy for 5000 s: on one node the job takes 2000 s, waiting for two: 5000 + 1000
    d = schedule(view([node("a"), node("b", (0,))], [ejob(1, 1, 2)], [running(9, ["b"], 5000.0)]))
    (p,) = d.placements
    assert [s.node for s in p.shares] == ["a"]
    assert "started on 1 of 2 nodes" in p.reason and "33 min" in p.reason


def test_waits_for_all_when_that_finishes_sooner():
    # b frees in 100 s: waiting finishes at 1100 s, one node now at 2000 s
    d = schedule(view([node("a"), node("b", (0,))], [ejob(1, 1, 2)], [running(9, ["b"], 100.0)]))
    assert not d.placements
    assert "waiting for free slots" in d.waiting[1]


def test_restart_now_ignores_the_wait():
    d = schedule(view([node("a"), node("b", (0,))], [ejob(1, 1, 2, restart_now=True)], [running(9, ["b"], 100.0)]))
    (p,) = d.placements
    assert len(p.shares) == 1 and "restarting at once on 1 of up to 2" in p.reason


def test_never_below_min():
    d = schedule(view([node("a"), node("b"), node("c", (0,))], [ejob(1, 3, 3)], [running(9, ["c"], 9e9)]))
    assert not d.placements
    d = schedule(view([node("a"), node("b", (0,)), node("c", (0,))], [ejob(1, 2, 3, restart_now=True)],
                      [running(9, ["b", "c"], 9e9)]))
    assert not d.placements


def test_max_larger_than_cluster_runs_on_what_exists():
    d = schedule(view([node("a"), node("b")], [ejob(1, 1, 4)]))
    assert [len(p.shares) for p in d.placements] == [2]


def test_backfill_rule_holds_for_the_smaller_start():
    # job 1 (fixed, 2 nodes) is the head, reserved at 500 s on a+b; elastic job 2 on one node would
    # run 4000 s, past the shadow, on a node the head needs: it may not start
    q = [QueuedJob(1, 5, 2, 1, submitted_at=0.0, predicted_s=100.0), ejob(2, 1, 2, predicted_s=2000.0, submitted_at=1.0)]
    d = schedule(view([node("a"), node("b", (0,))], q, [running(9, ["b"], 500.0)], policy="backfill"))
    assert not d.placements


def _elastic_running(id, nodes, lo, hi, end, **kw):
    shape = QueuedJob(id, kw.get("priority", 1), hi, 1, min_nodes=lo, submitted_at=kw.pop("submitted", 0.0),
                      team=kw.get("team"))
    return running(id, nodes, end, elastic=shape, **kw)


def test_grows_onto_free_nodes():
    d = schedule(view([node("a", (0,)), node("b")], run=[_elastic_running(1, ["a"], 1, 2, 5000.0)]))
    (pr,) = d.preemptions
    assert (pr.job_id, pr.resize_to, pr.for_job) == (1, 2, None)
    assert "growing from 1 to 2 node(s)" in pr.reason


def test_no_grow_near_its_end_or_when_a_better_claim_waits():
    nodes = [node("a", (0,)), node("b"), node("c", (0,))]
    r = _elastic_running(1, ["a"], 1, 2, 100.0)
    assert not schedule(view(nodes, run=[r, running(9, ["c"], 9e9)])).preemptions  # ends in 100 s
    r = _elastic_running(1, ["a"], 1, 2, 5000.0, submitted=10.0)
    waiting = QueuedJob(2, 1, 2, 1, submitted_at=5.0)  # earlier, needs 2 nodes: only b is free
    d = schedule(view(nodes, [waiting], [r, running(9, ["c"], 9e9)]))
    assert not d.preemptions and 2 in d.waiting
    later = QueuedJob(2, 1, 2, 1, submitted_at=50.0)  # later and not more urgent: the grow goes ahead
    d = schedule(view(nodes, [later], [r, running(9, ["c"], 9e9)]))
    assert [p.resize_to for p in d.preemptions] == [2]


def test_reclaim_shrinks_a_borrowing_elastic_job():
    # team x (quota 2) borrows all 4 nodes with an elastic job {1..4}; team y (quota 2) wants 2
    nodes = [node(n, (0,)) for n in "abcd"]
    r = _elastic_running(1, list("abcd"), 1, 4, 1e6, team="x", started=0.0)
    q = [QueuedJob(2, 1, 2, 1, team="y", submitted_at=5.0)]
    d = schedule(view(nodes, q, [r], now=10.0, quotas=Quotas({"x": 2, "y": 2})))
    (pr,) = d.preemptions
    assert (pr.job_id, pr.resize_to, pr.for_job) == (1, 1, 2)
    assert "shrinking to 1 node(s)" in pr.reason


def test_reclaim_stops_a_fixed_borrower_whole():
    nodes = [node(n, (0,)) for n in "abcd"]
    r = running(1, list("abcd"), 1e6, team="x")
    q = [QueuedJob(2, 1, 2, 1, team="y", submitted_at=5.0)]
    d = schedule(view(nodes, q, [r], now=10.0, quotas=Quotas({"x": 2, "y": 2})))
    assert [(p.job_id, p.resize_to) for p in d.preemptions] == [(1, None)]
