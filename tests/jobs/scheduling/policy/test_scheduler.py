"""Table-driven tests of the pure scheduler."""
import pytest

from jobs.scheduling.policy import NodeState, QueuedJob, fits_cluster, schedule


def n(name, slots=2, used=(), ok=True):
    return NodeState(name, f"addr-{name}", slots, frozenset(used), ok)


def j(id, nodes=1, ppn=1, prio=1):
    return QueuedJob(id, prio, nodes, ppn)


CASES = [
    # (description, nodes, queue, expected {job: [(node, slots)...]}, expected waiting ids)
    ("fifo within priority", [n("a", 1)], [j(2), j(1)], {1: [("a", (0,))]}, {2}),
    ("priority first", [n("a", 1)], [j(1), j(2, prio=2)], {2: [("a", (0,))]}, {1}),
    ("gang: two nodes or nothing", [n("a"), n("b", used=(0, 1))], [j(1, nodes=2)], {}, {1}),
    ("gang spans distinct nodes", [n("a"), n("b")], [j(1, nodes=2, ppn=2)],
     {1: [("a", (0, 1)), ("b", (0, 1))]}, set()),
    ("first fit skips a full node", [n("a", used=(0, 1)), n("b")], [j(1, ppn=2)], {1: [("b", (0, 1))]}, set()),
    ("uses free slot ids", [n("a", 3, used=(0,))], [j(1, ppn=2)], {1: [("a", (1, 2))]}, set()),
    ("strict queue: head blocks smaller jobs behind it", [n("a", used=(0,)), n("b", used=(0,))],
     [j(1, nodes=1, ppn=2), j(2)], {}, {1, 2}),
    ("job that can never fit today does not block", [n("a")], [j(1, nodes=3), j(2)],
     {2: [("a", (0,))]}, {1}),
    ("unschedulable nodes take no work", [n("a", ok=False), n("b")], [j(1, nodes=2)], {}, {1}),
    ("packs several jobs in one tick", [n("a"), n("b")], [j(1, nodes=2), j(2, nodes=2), j(3)],
     {1: [("a", (0,)), ("b", (0,))], 2: [("a", (1,)), ("b", (1,))]}, {3}),
]


@pytest.mark.parametrize("desc,nodes,queue,placed,waiting", CASES, ids=[c[0] for c in CASES])
def test_schedule(desc, nodes, queue, placed, waiting):
    d = schedule(nodes, queue)
    got = {p.job_id: [(s.node, s.slot_ids) for s in p.shares] for p in d.placements}
    assert got == placed
    assert set(d.waiting) == waiting
    for p in d.placements:
        assert [s.node_rank for s in p.shares] == list(range(len(p.shares)))


def test_never_double_books_a_slot():
    nodes = [n("a", 4), n("b", 4)]
    queue = [j(i, nodes=1 + i % 2, ppn=1 + i % 3) for i in range(1, 20)]
    used: dict = {}
    for p in schedule(nodes, queue).placements:
        for s in p.shares:
            for slot in s.slot_ids:
                assert (s.node, slot) not in used
                used[(s.node, slot)] = p.job_id


@pytest.mark.parametrize("nodes_needed,ppn,expected", [(2, 2, True), (3, 1, False), (1, 3, False)])
def test_fits_cluster(nodes_needed, ppn, expected):
    assert fits_cluster([n("a"), n("b")], nodes_needed, ppn) is expected


def test_restart_avoids_implicated_node_when_it_can():
    from jobs.scheduling.policy import NodeState, QueuedJob, schedule

    nodes = [NodeState("a", "127.0.0.1", 2, frozenset()), NodeState("b", "127.0.0.2", 2, frozenset()),
             NodeState("c", "127.0.0.3", 2, frozenset())]
    d = schedule(nodes, [QueuedJob(1, 1, 2, 1, avoid=frozenset({"a"}))])
    assert [s.node for s in d.placements[0].shares] == ["b", "c"]
    # without the avoided node it could never fit: it runs there anyway rather than wait forever
    d = schedule(nodes[:2], [QueuedJob(1, 1, 2, 1, avoid=frozenset({"a"}))])
    assert [s.node for s in d.placements[0].shares] == ["a", "b"]
    # it fits without "a" but "b" is busy: wait, and say why
    busy = [nodes[0], NodeState("b", "127.0.0.2", 2, frozenset({0, 1})), nodes[2]]
    d = schedule(busy, [QueuedJob(1, 1, 2, 1, avoid=frozenset({"a"}))])
    assert not d.placements and "avoiding a" in d.waiting[1]


# ---------------------------------------------------------------- the full policy (ClusterView)

import random  # noqa: E402

from jobs.scheduling import policy as S  # noqa: E402
from jobs.scheduling.policy import ClusterView, Quotas, RunningJob, eta_changes, predict_starts, queue_order, running_borrowing, team_usage  # noqa: E402

NOW = 10_000.0


def node(name, slots=4, used=(), ok=True, rack=None):
    return NodeState(name, f"addr-{name}", slots, frozenset(used), ok, rack)


def q(id, nodes=1, ppn=1, prio=1, team=None, user="u", sub=0.0, pred=3600.0, avoid=()):
    return QueuedJob(id, prio, nodes, ppn, frozenset(avoid), team, user, NOW - 1000 + sub, pred)


def run(id, team, shares, started=0.0, end=NOW + 3600, prio=1, user="r", preemptible=True, for_job=None):
    shares = tuple((n, tuple(ids)) for n, ids in shares)
    return RunningJob(id, team, user, sum(len(i) for _, i in shares), prio, shares, NOW - 5000 + started, end,
                      preemptible, for_job)


def used_by(running, name):
    return frozenset(i for r in running for n, ids in r.nodes if n == name for i in ids)


def cluster(spec, running=()):
    """spec: [(name, slots, rack)]; used slots come from the running jobs."""
    return tuple(node(n, s, used_by(running, n), rack=r) for n, s, r in spec)


def view(nodes, queue=(), running=(), teams=None, caps=None, over=(), policy="trainyard", usage=None):
    return ClusterView(NOW, tuple(nodes), tuple(running), tuple(queue),
                       Quotas(teams or {}, caps or {}, frozenset(over)), usage or {}, policy)


def placed(d):
    return {p.job_id: [(s.node, s.slot_ids) for s in p.shares] for p in d.placements}


# (description, view, expected placements {job: [(node, slots)]}, expected borrowing placements)
QUOTA_CASES = [
    ("within quota: not borrowing",
     view([node("a")], [q(1, ppn=2, team="nlp")], teams={"nlp": 2}), {1: [("a", (0, 1))]}, set()),
    ("beyond quota on idle slots: borrowing",
     view([node("a")], [q(1, ppn=3, team="nlp")], teams={"nlp": 2}), {1: [("a", (0, 1, 2))]}, {1}),
    ("no quota: never borrowing", view([node("a")], [q(1, ppn=4, team="cv")]), {1: [("a", (0, 1, 2, 3))]}, set()),
    ("running within-quota slots count",
     view(cluster([("a", 4, None)], [r := run(9, "nlp", [("a", (0, 1))])]), [q(1, team="nlp")], [r],
          teams={"nlp": 2}), {1: [("a", (2,))]}, {1}),
    ("the second job of a tick sees the first",
     view([node("a")], [q(1, team="nlp", sub=0), q(2, team="nlp", sub=1)], teams={"nlp": 1}),
     {1: [("a", (0,))], 2: [("a", (1,))]}, {2}),
]


@pytest.mark.parametrize("desc,v,expected,borrowing", QUOTA_CASES, ids=[c[0] for c in QUOTA_CASES])
def test_quota_admission_and_borrowing(desc, v, expected, borrowing):
    d = schedule(v)
    assert placed(d) == expected
    assert {p.job_id for p in d.placements if p.borrowing} == borrowing


def test_lowering_a_quota_makes_the_newest_jobs_borrowers():
    rs = [run(1, "nlp", [("a", (0, 1))], started=10), run(2, "nlp", [("a", (2,))], started=20),
          run(3, "nlp", [("b", (0,))], started=30), run(4, "cv", [("b", (1,))], started=5)]
    assert running_borrowing(rs, {"nlp": 4}) == frozenset()
    assert running_borrowing(rs, {"nlp": 3}) == {3}          # 2 + 1 fit, the newest does not
    assert running_borrowing(rs, {"nlp": 2}) == {2, 3}       # first fit in start order
    assert running_borrowing(rs, {"nlp": 1}) == {1, 3}       # job 2 (1 slot) still fits the quota
    v = view(cluster([("a", 4, None), ("b", 4, None)], rs), [q(9, team="nlp")], rs, teams={"nlp": 2, "cv": 1})
    assert schedule(v).borrowing == {2, 3}
    assert team_usage(v) == {"nlp": {"quota": 2, "in_use": 4, "borrowed": 2, "queued": 1},
                             "cv": {"quota": 1, "in_use": 1, "borrowed": 0, "queued": 0}}


# Reclaim: a 4-slot node "a" fully used by borrowers of team cv (quota 1) and the nlp job needs slots.
def reclaim_case(running, job, teams=None, nodes=(("a", 4, None),)):
    return view(cluster(nodes, running), [job], running, teams=teams or {"nlp": 4, "cv": 1, "ml": 2})


RECLAIM_CASES = [
    ("lowest priority first",
     [run(1, "cv", [("a", (0,))], started=0), run(2, "cv", [("a", (1,))], started=1, prio=2),
      run(3, "cv", [("a", (2, 3))], started=2, prio=0)],
     q(10, ppn=2, team="nlp"), {3}),
    ("most recently started first (least work lost)",
     [run(1, "cv", [("a", (0,))], started=0), run(2, "cv", [("a", (1,))], started=1),
      run(3, "cv", [("a", (2,))], started=3), run(4, "cv", [("a", (3,))], started=2)],
     q(10, ppn=2, team="nlp"), {3, 4}),
    ("only borrowers: the team's within-quota job is safe",
     [run(1, "cv", [("a", (0,))], started=0), run(2, "cv", [("a", (1, 2, 3))], started=1)],
     q(10, ppn=3, team="nlp"), {2}),
    ("never the reclaiming team's own borrowers",
     [run(1, "nlp", [("a", (0, 1, 2, 3))], started=0)], q(10, ppn=1, team="nlp"), set()),
    ("a borrowing job does not reclaim",
     [run(1, "cv", [("a", (0,))]), run(2, "cv", [("a", (1, 2, 3))], started=1)], q(10, ppn=3, team="ml"), set()),
    ("no quota, no reclaim",
     [run(1, "cv", [("a", (0,))]), run(2, "cv", [("a", (1, 2, 3))], started=1)], q(10, ppn=3, team="x"), set()),
    ("not when running jobs end soon anyway",
     [run(1, "cv", [("a", (0,))]), run(2, "cv", [("a", (1, 2, 3))], started=1, end=NOW + 60)],
     q(10, ppn=3, team="nlp"), set()),
    ("not when preempting could not make it fit (gang on two nodes)",
     [run(1, "cv", [("a", (0,))]), run(2, "cv", [("a", (1, 2, 3))], started=1)],
     q(10, nodes=2, ppn=2, team="nlp"), set()),
    ("minimal set: a big recent victim makes an earlier small one unnecessary",
     [run(1, "cv", [("a", (0,))], started=0), run(2, "cv", [("a", (1,))], started=2),
      run(3, "cv", [("a", (2, 3))], started=1)],
     q(10, ppn=2, team="nlp"), {3}),
    ("victims may have any priority: the quota is a guarantee",
     [run(1, "cv", [("a", (0,))]), run(2, "cv", [("a", (1, 2, 3))], started=1, prio=2)],
     q(10, ppn=3, team="nlp", prio=0), {2}),
]


@pytest.mark.parametrize("desc,running,job,victims", RECLAIM_CASES, ids=[c[0] for c in RECLAIM_CASES])
def test_reclaim(desc, running, job, victims):
    d = schedule(reclaim_case(running, job))
    assert {p.job_id for p in d.preemptions} == victims
    assert not d.placements
    for p in d.preemptions:
        assert p.for_job == job.id and p.reason.startswith(f"reclaimed: team {job.team} needs its quota back")
    if victims:
        assert d.waiting[job.id].startswith("reclaiming quota")


def test_reclaim_only_under_trainyard():
    rs = [run(1, "cv", [("a", (0,))]), run(2, "cv", [("a", (1, 2, 3))], started=1)]
    for policy in ("fifo", "backfill"):
        v = reclaim_case(rs, q(10, ppn=3, team="nlp"))
        assert not schedule(ClusterView(v.now, v.nodes, v.running, v.queue, v.quotas, {}, policy)).preemptions


def test_reclaim_reason_names_the_teams_and_quotas():
    rs = [run(1, "cv", [("a", (0,))]), run(2, "cv", [("a", (1, 2, 3))], started=1)]
    (p,) = schedule(reclaim_case(rs, q(12, ppn=3, team="nlp"))).preemptions
    assert p.reason == ("reclaimed: team nlp needs its quota back for job 12 (team cv is 3 slot(s) over its "
                        "quota of 1; team nlp's quota is 4)")


def test_in_flight_preemption_holds_the_slots_and_is_not_repeated():
    # job 2 is being preempted for job 10; slot 0 of node b is free: job 10 (needs 2 slots on one
    # node) will use a's freed slots, and nobody may take... a has no free slot, so it holds nothing
    # there; a 1-slot job 11 behind it may use b.
    victim = run(2, "cv", [("a", (1, 2, 3))], started=1, preemptible=False, for_job=10)
    rs = [run(1, "cv", [("a", (0,))]), victim, run(3, "cv", [("b", (1, 2, 3))], started=2)]
    nodes = cluster([("a", 4, None), ("b", 4, None)], rs)
    v = view(nodes, [q(10, ppn=3, team="nlp"), q(11, ppn=1, team="cv", pred=99999)], rs,
             teams={"nlp": 4, "cv": 1})
    d = schedule(v)
    assert not d.preemptions                     # never reclaimed for twice
    assert "to checkpoint and stop" in d.waiting[10]
    assert placed(d) == {11: [("b", (0,))]}       # b is not what job 10 needs
    # the same, but job 10 needs a whole node and b's free slot is part of its best plan: held
    victim = run(2, "cv", [("b", (1, 2, 3))], started=1, preemptible=False, for_job=10)
    rs = [run(1, "cv", [("a", (0, 1, 2, 3))]), victim]
    nodes = cluster([("a", 4, None), ("b", 4, None)], rs)
    v = view(nodes, [q(10, ppn=4, team="nlp"), q(11, ppn=1, team="cv", pred=1)], rs, teams={"nlp": 4, "cv": 1})
    d = schedule(v)
    assert not d.preemptions and not d.placements  # job 11 would end in a second, but the slot is held
    # once the victim has exited, job 10 starts there
    nodes = cluster([("a", 4, None), ("b", 4, None)], rs[:1])
    d = schedule(view(nodes, [q(10, ppn=4, team="nlp"), q(11, ppn=1, team="cv")], rs[:1], teams={"nlp": 4, "cv": 1}))
    assert placed(d) == {10: [("b", (0, 1, 2, 3))]}


TOPOLOGY_CASES = [
    ("best fit: the fullest node that still fits",
     [node("a", 4), node("b", 4, used=(0, 1)), node("c", 4, used=(0, 1, 2))], q(1, ppn=2), [("b", (2, 3))]),
    ("best fit keeps whole nodes for large jobs",
     [node("a", 8), node("b", 8, used=(0,))], q(1, ppn=1), [("b", (1,))]),
    ("multi-node: one rack when a rack can hold it",
     [node("a", 2, rack="r1"), node("b", 2, used=(0, 1), rack="r1"), node("c", 2, rack="r2"),
      node("d", 2, rack="r2")], q(1, nodes=2, ppn=1), [("c", (0,)), ("d", (0,))]),
    ("multi-node: the tightest rack",
     [node("a", 4, rack="r1"), node("b", 4, rack="r1"), node("c", 4, used=(0, 1), rack="r2"),
      node("d", 4, used=(0, 1), rack="r2")], q(1, nodes=2, ppn=2), [("c", (2, 3)), ("d", (2, 3))]),
    ("multi-node: spans racks when no rack can hold it",
     [node("a", 2, rack="r1"), node("b", 2, used=(0, 1), rack="r1"), node("c", 2, rack="r2"),
      node("d", 2, used=(0, 1), rack="r2")], q(1, nodes=2, ppn=2), [("a", (0, 1)), ("c", (0, 1))]),
    ("gang: all shares or none", [node("a", 2), node("b", 2, used=(0,))], q(1, nodes=2, ppn=2), None),
]


@pytest.mark.parametrize("desc,nodes,job,expected", TOPOLOGY_CASES, ids=[c[0] for c in TOPOLOGY_CASES])
def test_placement(desc, nodes, job, expected):
    d = schedule(view(nodes, [job]))
    assert placed(d).get(job.id) == expected


# Backfill: node a (4 slots) has 2 free; 2 slots free at NOW+1000 when job 9 ends. Head job 1
# needs 4 slots on one node (shadow NOW+1000).
BASE_RUN = [run(9, None, [("a", (0, 1))], end=NOW + 1000)]
BACKFILL_CASES = [
    ("a short job backfills", [q(1, ppn=4, sub=0), q(2, ppn=2, sub=1, pred=500)], {2}),
    ("a long job would delay the head: it waits", [q(1, ppn=4, sub=0), q(2, ppn=2, sub=1, pred=5000)], set()),
    ("a long job may use slots the head does not need",
     [q(1, ppn=3, sub=0), q(2, ppn=1, sub=1, pred=5000)], {2}),
    ("lower priority cannot jump a blocked higher-priority head",
     [q(1, ppn=4, prio=2, sub=1), q(2, ppn=2, prio=1, sub=0, pred=5000)], set()),
]


@pytest.mark.parametrize("policy", ["backfill", "trainyard"])
@pytest.mark.parametrize("desc,queue,started", BACKFILL_CASES, ids=[c[0] for c in BACKFILL_CASES])
def test_backfill(desc, queue, started, policy):
    if policy == "backfill" and desc.startswith("lower priority"):
        started = set()  # FIFO by submission: job 2 came first and starts
        d = schedule(view(cluster([("a", 4, None)], BASE_RUN), queue, BASE_RUN, policy=policy))
        assert {p.job_id for p in d.placements} == {2}
        return
    d = schedule(view(cluster([("a", 4, None)], BASE_RUN), queue, BASE_RUN, policy=policy))
    assert {p.job_id for p in d.placements} == started
    if not started:
        assert "would delay job 1" in d.waiting[2]
        assert "expected to start in about 17 min" in d.waiting[1]


def test_fifo_is_strict_and_ignores_priority():
    nodes = cluster([("a", 4, None)], BASE_RUN)
    d = schedule(view(nodes, [q(1, ppn=4, sub=0), q(2, ppn=1, sub=1, pred=1, prio=2)], BASE_RUN, policy="fifo"))
    assert not d.placements and d.waiting[2] == "behind job 1 in the queue"
    assert d.order == (1, 2)


def _random_view(rng, policy):
    nodes, running, rid = [], [], 1000
    for i in range(rng.randint(2, 6)):
        slots = rng.choice([2, 4, 8])
        k = 0
        while k < slots and rng.random() < 0.6:
            take = rng.randint(1, slots - k)
            running.append(run(rid, rng.choice(["a", "b", None]), [(f"n{i}", tuple(range(k, k + take)))],
                               started=rng.uniform(0, 100), end=NOW + rng.uniform(-100, 5000),
                               prio=rng.randint(0, 2)))
            rid += 1
            k += take
        nodes.append((f"n{i}", slots, rng.choice(["r1", "r2", None])))
    queue = [q(j, nodes=rng.choice([1, 1, 1, 2]), ppn=rng.choice([1, 1, 2, 4]), prio=rng.randint(0, 2),
               team=rng.choice(["a", "b", None]), sub=rng.uniform(0, 500), pred=rng.uniform(10, 8000))
             for j in range(1, rng.randint(2, 14))]
    return view(cluster(nodes, running), queue, running, teams={"a": rng.randint(0, 12), "b": rng.randint(0, 12)},
                policy=policy)


def _apply(v, d, upto=None):
    """The view after the decision's placements (those of jobs before `upto` in order, if given)."""
    qs = {j.id: j for j in v.queue}
    keep = None if upto is None else set(d.order[: d.order.index(upto)])
    running = list(v.running)
    for p in d.placements:
        if keep is None or p.job_id in keep:
            j = qs[p.job_id]
            running.append(RunningJob(j.id, j.team, j.user, j.slots, j.priority,
                                      tuple((s.node, s.slot_ids) for s in p.shares), v.now, v.now + j.predicted_s))
    nodes = tuple(NodeState(n.name, n.address, n.slots, used_by(running, n.name), n.schedulable, n.rack)
                  for n in v.nodes)
    return nodes, tuple(running)


@pytest.mark.parametrize("policy", ["backfill", "trainyard"])
def test_backfill_never_delays_the_head(policy):
    rng = random.Random(7)
    checked = 0
    for _ in range(300):
        v = _random_view(rng, policy)
        d = schedule(v)
        if d.preemptions:
            continue
        placed_ids = {p.job_id for p in d.placements}
        head = next((jid for jid in d.order if jid not in placed_ids
                     and S.fits_cluster(v.nodes, *(lambda j: (j.nodes, j.procs_per_node))(
                         next(x for x in v.queue if x.id == jid)))), None)
        if head is None:
            continue
        job = next(x for x in v.queue if x.id == head)
        before = _apply(v, d, upto=head)
        after = _apply(v, d)
        eta_before = predict_starts(ClusterView(v.now, before[0], before[1], (job,), v.quotas, {}, policy)).get(head)
        eta_after = predict_starts(ClusterView(v.now, after[0], after[1], (job,), v.quotas, {}, policy)).get(head)
        if eta_before is None:
            continue
        assert eta_after is not None and eta_after <= eta_before + 1e-6, (v, d)
        checked += 1
    assert checked > 50


@pytest.mark.parametrize("policy", ["fifo", "backfill", "trainyard"])
def test_never_double_books_random_views(policy):
    rng = random.Random(3)
    for _ in range(200):
        v = _random_view(rng, policy)
        d = schedule(v)
        taken = {(n.name, i) for n in v.nodes for i in n.used_slot_ids}
        for p in d.placements:
            assert len(p.shares) == next(j.nodes for j in v.queue if j.id == p.job_id)
            assert len({s.node for s in p.shares}) == len(p.shares)
            for s in p.shares:
                assert next(n for n in v.nodes if n.name == s.node).schedulable
                for slot in s.slot_ids:
                    assert (s.node, slot) not in taken
                    taken.add((s.node, slot))
        assert set(d.order) == {j.id for j in v.queue}
        assert {p.job_id for p in d.placements}.isdisjoint(d.waiting)
        assert {p.job_id for p in d.placements} | set(d.waiting) == {j.id for j in v.queue}


GATE_CASES = [
    ("user cap is hard", dict(caps={"ann": 2}), [q(1, ppn=2, user="ann"), q(2, user="bob")],
     {2}, {1: "user ann is at their cap: 1 of 2 slot(s) in use, this job needs 2"}),
    ("a capped job does not block the queue", dict(caps={"ann": 1}), [q(1, user="ann", prio=2), q(2, user="bob")],
     {2}, {1: "user ann is at their cap: 1 of 1 slot(s) in use, this job needs 1"}),
    ("over budget team waits", dict(over={"nlp"}), [q(1, team="nlp"), q(2, team="cv")],
     {2}, {1: "team nlp has used its device-hours for the current window"}),
    ("over budget user waits", dict(over={"user:ann"}), [q(1, user="ann"), q(2, user="bob")],
     {2}, {1: "user ann has used their device-hours for the current window"}),
]


@pytest.mark.parametrize("desc,kw,queue,started,reasons", GATE_CASES, ids=[c[0] for c in GATE_CASES])
def test_gates(desc, kw, queue, started, reasons):
    rs = [run(9, None, [("a", (0,))], user="ann")]
    d = schedule(view(cluster([("a", 4, None)], rs), queue, rs, **kw))
    assert {p.job_id for p in d.placements} == started
    for jid, reason in reasons.items():
        assert d.waiting[jid] == reason


ORDER_CASES = [
    ("priority first", dict(), [q(1, prio=1, sub=0), q(2, prio=2, sub=1)], [2, 1]),
    ("shortest predicted first within a team", dict(), [q(1, pred=5000, sub=0), q(2, pred=50, sub=1)], [2, 1]),
    ("aging: a long job that waited beats a fresh short one",
     dict(), [q(1, pred=7200, sub=-20 * 3600), q(2, pred=600, sub=999)], [1, 2]),
    ("fair share: the team that used less goes first",
     dict(usage={"cv": 1e6, "nlp": 0.0}), [q(1, team="cv", sub=0), q(2, team="nlp", sub=1)], [2, 1]),
    ("fair share is weighted by entitlement",
     dict(usage={"cv": 3e5, "nlp": 2e5}, teams={"cv": 30, "nlp": 10}),
     [q(1, team="nlp", sub=0), q(2, team="cv", sub=1)], [2, 1]),
    ("fair share interleaves teams",
     dict(), [q(1, team="cv", sub=0), q(2, team="cv", sub=1), q(3, team="nlp", sub=2), q(4, team="nlp", sub=3)],
     [1, 3, 2, 4]),
    ("within-quota jobs before borrowers, whatever their priority",
     dict(teams={"cv": 1, "nlp": 1}), [q(1, team="cv", prio=2, sub=0), q(2, team="cv", prio=2, sub=1),
                                       q(3, team="nlp", prio=0, sub=2)], [1, 3, 2]),
]


@pytest.mark.parametrize("desc,kw,queue,expected", ORDER_CASES, ids=[c[0] for c in ORDER_CASES])
def test_queue_order(desc, kw, queue, expected):
    v = view([node("a", 64)], queue, **kw)
    assert [j.id for j in queue_order(v)] == expected
    assert schedule(v).order == tuple(expected)


def test_backfill_policy_orders_by_submission_only():
    v = view([node("a")], [q(1, prio=0, sub=0, pred=9999), q(2, prio=2, sub=1, pred=1)], policy="backfill")
    assert [j.id for j in queue_order(v)] == [1, 2]


def test_queue_order_of_a_bare_list_is_the_old_order():
    assert [j.id for j in queue_order([j(3), j(1, prio=0), j(2)])] == [2, 3, 1]


def test_unknown_policy():
    with pytest.raises(ValueError, match="unknown policy"):
        schedule(view([node("a")], [q(1)], policy="sjf"))


# ---------------------------------------------------------------- start-time predictions

def test_predict_starts():
    rs = [run(9, None, [("a", (0, 1, 2))], end=NOW + 1000), run(8, None, [("b", (0, 1, 2, 3))], end=NOW + 3000)]
    nodes = cluster([("a", 4, None), ("b", 4, None)], rs)
    queue = [q(1, ppn=4, sub=0, pred=600),      # head: a frees at +1000
             q(2, ppn=1, sub=1, pred=100),      # backfills now on a's free slot
             q(3, ppn=4, sub=2, pred=700),      # b frees at +3000 (a is busy with job 1 until +1600)
             q(4, ppn=8, sub=3),                # never fits: no prediction
             q(5, ppn=1, sub=4, team="nlp")]    # over budget: no prediction
    eta = predict_starts(view(nodes, queue, rs, over={"nlp"}))
    assert eta == {1: NOW + 1000, 2: NOW, 3: NOW + 1600}
    assert predict_starts(view(nodes, queue[:3], rs), max_jobs=1) == {2: NOW}
    assert predict_starts(view(nodes, [q(1, ppn=4)], rs)) == {1: NOW + 1000}


def test_eta_changes_writes_only_what_moved():
    old = {1: 100.0, 2: 200.0, 3: 300.0}
    new = {1: 110.0, 2: 260.0, 4: 400.0}
    assert eta_changes(old, new, tolerance_s=30) == {2: 260.0, 3: None, 4: 400.0}


def test_the_entry_points_pause_the_cyclic_gc_and_restore_it():
    """schedule, queue_order and predict_starts run with the cyclic GC off (policy/cluster.py's
    gc_paused) and leave it as they found it, also when they raise."""
    import gc

    from jobs.scheduling.policy import ClusterView, predict_starts, queue_order
    from jobs.scheduling.policy.cluster import gc_paused

    seen = []
    probe = gc_paused(lambda: seen.append(gc.isenabled()))
    view = ClusterView(0.0, (n("a"),), (), (j(1),))
    was = gc.isenabled()
    try:
        for state in (True, False):
            (gc.enable if state else gc.disable)()
            probe()
            schedule(view), queue_order(view), predict_starts(view)
            assert gc.isenabled() is state
            with pytest.raises(ValueError):
                schedule(ClusterView(0.0, (), policy="lifo"))
            assert gc.isenabled() is state
    finally:
        (gc.enable if was else gc.disable)()
    assert seen == [False, False]
