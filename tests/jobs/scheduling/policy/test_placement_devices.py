"""Device-aware placement (issue 16, section 4): a cuda job lands only on nodes whose heartbeat
advertises enough GPUs (of enough memory), one slot per GPU; `resources.labels` must all match a
node's labels; a job no node can serve waits with the reason. Pure policy, table-driven."""
import pytest

from jobs.scheduling.policy import ClusterView, NodeState, QueuedJob, RunningJob, predict_starts, schedule
from jobs.fleet.policy.devices import summarize_devices
from jobs.scheduling.policy.eligibility import node_slots, unservable_reason

GB = 10**9


def cpu(name, slots=2, used=(), ok=True, labels=()):
    return NodeState(name, f"addr-{name}", slots, frozenset(used), ok, None, "cpu", 0, 0, tuple(sorted(labels)))


def gpu(name, gpus=2, mem_gb=80, used=(), ok=True, labels=()):
    return NodeState(name, f"addr-{name}", gpus, frozenset(used), ok, None, "cuda", gpus, mem_gb * GB,
                     tuple(sorted(labels)))


def job(id, nodes=1, ppn=1, device="cpu", mem_gb=0, labels=(), avoid=()):
    return QueuedJob(id, 1, nodes, ppn, frozenset(avoid), device=device, gpu_memory_bytes=int(mem_gb * GB),
                     labels=tuple(sorted(labels)))


CASES = [
    # (description, nodes, queue, expected {job: [(node, slot ids)]}, {job: reason fragment})
    ("cuda job never lands on cpu-only nodes", [cpu("a"), cpu("b")], [job(1, device="cuda")], {},
     {1: "no READY node has cuda devices"}),
    ("cuda job takes the gpu node, not the emptier cpu node", [cpu("a", 8), gpu("g", 2)], [job(1, device="cuda")],
     {1: [("g", (0,))]}, {}),
    ("cpu job keeps today's behaviour: any node", [gpu("g", 2)], [job(1)], {1: [("g", (0,))]}, {}),
    ("one slot per gpu: 2 ranks need 2 free gpus", [gpu("g", 2, used=(0,)), gpu("h", 4)],
     [job(1, ppn=2, device="cuda")], {1: [("h", (0, 1))]}, {}),
    ("more gpus per node than any node has", [gpu("g", 2), gpu("h", 2)], [job(1, ppn=4, device="cuda")], {},
     {1: "needs 1 READY node(s) with 4 cuda GPU(s) each; 2 such node(s), with at most 2"}),
    ("gpu memory: the 40 GB node is skipped for an 80 GB job", [gpu("small", 2, 40), gpu("big", 2, 80)],
     [job(1, device="cuda", mem_gb=80)], {1: [("big", (0,))]}, {}),
    ("gpu memory no node has", [gpu("small", 2, 40)], [job(1, device="cuda", mem_gb=80)], {},
     {1: "no READY node has cuda devices of at least 80 GB each (the largest have 40.0 GB)"}),
    ("labels: all must match", [cpu("a", labels={"gpu": "a100"}.items()),
                                cpu("b", labels={"gpu": "a100", "rack": "r2"}.items())],
     [job(1, labels={"gpu": "a100", "rack": "r2"}.items())], {1: [("b", (0,))]}, {}),
    ("labels no node has", [cpu("a", labels={"gpu": "h100"}.items())], [job(1, labels={"gpu": "a100"}.items())], {},
     {1: "no READY node has labels gpu=a100"}),
    ("cuda and labels", [gpu("g", labels={"rack": "r1"}.items())],
     [job(1, device="cuda", labels={"rack": "r2"}.items())], {},
     {1: "no READY node with cuda devices has labels rack=r2"}),
    ("a gpu node that is not READY does not count", [gpu("g", ok=False), cpu("a")], [job(1, device="cuda")], {},
     {1: "no READY node has cuda devices"}),
    ("the unservable cuda job blocks nobody", [cpu("a", 1)], [job(1, device="cuda"), job(2)],
     {2: [("a", (0,))]}, {1: "no READY node has cuda devices"}),
    ("avoid stays soft, eligibility hard", [gpu("g"), cpu("a")], [job(1, device="cuda", avoid=("g",))],
     {1: [("g", (0,))]}, {}),
]


@pytest.mark.parametrize("desc,nodes,queue,placed,reasons", CASES, ids=[c[0] for c in CASES])
def test_device_placement(desc, nodes, queue, placed, reasons):
    d = schedule(nodes, queue)
    got = {p.job_id: [(s.node, s.slot_ids) for s in p.shares] for p in d.placements}
    assert got == placed
    assert set(d.waiting) == set(reasons)
    for job_id, fragment in reasons.items():
        assert fragment in d.waiting[job_id]


def test_gang_of_cuda_job_uses_only_gpu_nodes():
    nodes = [cpu("a", 4), cpu("b", 4), gpu("g1", 2), gpu("g2", 2)]
    d = schedule(nodes, [job(1, nodes=2, ppn=2, device="cuda")])
    assert [(s.node, s.slot_ids) for s in d.placements[0].shares] == [("g1", (0, 1)), ("g2", (0, 1))]


def test_busy_gpu_node_means_waiting_for_slots_not_for_nodes():
    d = schedule([gpu("g", 1, used=(0,)), cpu("a", 4)], [job(1, device="cuda")])
    assert not d.placements and d.waiting[1].startswith("waiting for free slots")


def test_no_start_time_predicted_for_a_job_no_node_can_serve():
    view = ClusterView(0.0, (cpu("a"),), queue=(job(1, device="cuda"), job(2)))
    etas = predict_starts(view)
    assert 1 not in etas and etas[2] == 0.0


def test_submit_wording_counts_every_registered_node():
    assert unservable_reason([gpu("g", ok=False)], job(1, device="cuda"), schedulable_only=False) is None
    assert (unservable_reason([cpu("a")], job(1, device="cuda"), schedulable_only=False)
            == "no registered node has cuda devices")


@pytest.mark.parametrize("devices,summary", [
    ([{"kind": "cpu", "index": 0, "cores": 4}, {"kind": "cpu", "index": 1, "cores": 4}], ("cpu", 0, 0)),
    ([{"kind": "cuda", "index": 0, "memory_bytes": 80 * GB, "memory_used_bytes": 1},
      {"kind": "cuda", "index": 1, "memory_bytes": 40 * GB, "memory_used_bytes": 0}], ("cuda", 2, 40 * GB)),
    ([], ("", 0, 0)),  # a cuda agent whose NVML failed this heartbeat
    ([{"kind": "cuda", "memory_bytes": "junk"}, "junk"], ("cuda", 1, 0)),
])
def test_summarize_heartbeat_devices(devices, summary):
    assert summarize_devices(devices) == summary


def test_a_gpu_node_offers_one_slot_per_advertised_gpu():
    assert node_slots(4, "cuda", 3) == 3   # a GPU fell off the bus
    assert node_slots(2, "cuda", 8) == 2   # staff registered 2 slots
    assert node_slots(4, "", 0) == 4       # nothing advertised: a cpu job may still run there
    assert node_slots(4, "cpu", 0) == 4


def test_pool_counts_agree_with_a_plain_exclusion_set_as_slots_come_and_go():
    """count_fit over a PoolExclusion (a requirement's own ge counts, so a mixed cluster's
    prediction costs what a plain one does: 10,000 jobs on 1,000 half-GPU nodes went from 8.6 s
    to 1.3 s) must count what the same exclusion as a plain set counts."""
    import random

    from jobs.scheduling.policy.placement import FreeSlots, PoolExclusion

    rng = random.Random(7)
    nodes = [gpu(f"g{i}", rng.choice([1, 2, 4]), ok=rng.random() > 0.2) if i % 2 else cpu(f"c{i}", rng.choice([2, 8]))
             for i in range(40)]
    free = FreeSlots(nodes)
    members = [i for i, name in enumerate(free.names) if name.startswith("g")]
    avoid = frozenset(members[:3])
    outside = frozenset(range(len(free.names))) - frozenset(members)
    ex = PoolExclusion(outside | avoid, free.add_pool(members), avoid)
    held: list = []
    for _ in range(300):
        i = rng.randrange(len(free.names))
        if held and rng.random() < 0.4:
            j, ids = held.pop(rng.randrange(len(held)))
            free.release(j, ids)
        elif free.avail[i]:
            held.append((i, free.take(i, rng.randint(1, free.avail[i]))))
        overlay = {rng.randrange(len(free.names)): rng.randint(1, 3)} if rng.random() < 0.5 else None
        for ppn in range(0, 6):
            assert free.count_fit(ppn, ex, overlay) == free.count_fit(ppn, set(ex), overlay)


def test_pool_and_plain_jobs_of_one_shape_each_stay_on_their_own_nodes():
    """A Slurm pool's seats run only its jobs and its jobs only there, also when a plain job of the
    same shape comes first in the tick (the tick computes a plain job's exclusion once per shape:
    a pool job is not plain) or a pool job's failure to fit comes first in a prediction's pass."""
    nodes = (cpu("a", 8), cpu("b", 8), NodeState("s1", "addr-s1", 8, frozenset(), pool="p"),
             NodeState("s2", "addr-s2", 8, frozenset(), pool="p"))
    queue = tuple(QueuedJob(i, 1, 1, 8, submitted_at=i, pool=pool) for i, pool in ((1, ""), (2, "p"), (3, "p"), (4, "")))
    d = schedule(ClusterView(10.0, nodes, (), queue))
    assert {p.job_id: p.shares[0].node for p in d.placements} == {1: "a", 2: "s1", 3: "s2", 4: "b"}
    # the seats and node a are busy until t=1000; a plain 2-node job heads the queue, a short pool
    # job behind it cannot fit now, and a short plain job behind that can, on node b
    busy = tuple(NodeState(n.name, n.address, 8, frozenset(range(8)) if n.name != "b" else frozenset(), pool=n.pool)
                 for n in nodes)
    running = (RunningJob(90, None, "u", 16, 1, (("s1", tuple(range(8))), ("s2", tuple(range(8)))), 0.0, 1000.0),
               RunningJob(91, None, "u", 8, 1, (("a", tuple(range(8))),), 0.0, 1000.0))
    queue = (QueuedJob(1, 1, 2, 8, submitted_at=1), QueuedJob(2, 1, 1, 8, submitted_at=2, pool="p", predicted_s=50),
             QueuedJob(3, 1, 1, 8, submitted_at=3, predicted_s=50))
    view = ClusterView(10.0, busy, running, queue, policy="backfill")
    assert predict_starts(view)[3] == 10.0
    assert {p.job_id for p in schedule(view).placements} == {3}
