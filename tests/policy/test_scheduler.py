"""Table-driven tests of the pure scheduler."""
import pytest

from jobs.policy.scheduler import NodeState, QueuedJob, fits_cluster, schedule


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
    from jobs.policy.scheduler import NodeState, QueuedJob, schedule

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
