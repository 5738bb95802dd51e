"""The trace simulator (pure) and `manage.py simulate` (no database)."""
import io
import json
import math

import pytest
from django.core.management import CommandError, call_command

from jobs.scheduling.policy.fairshare import UsageMeter, decayed_slot_seconds, decayed_usage
from jobs.scheduling.simulation import SimConfig, TraceError, TraceJob, gang_shape, read_quotas, read_trace, simulate

HEADER = "job_id,submit_s,user,team,slots,duration_s,estimate_s,priority"


def tj(id, submit, slots, duration, team="a", user=None, estimate=None, prio=1):
    return TraceJob(id, submit, user or f"{team}-u", team, slots, duration, estimate or duration * 2, prio)


READ_ERRORS = [
    ("empty file", "", "is empty"),
    ("missing columns", "job_id,submit_s\n1,0\n", "lacks column(s) user, team, slots"),
    ("not a number", f"{HEADER}\n1,0,u,t,two,10,10,1\n", "line 2: slots is not a number: 'two'"),
    ("not whole", f"{HEADER}\n1,0,u,t,1.5,10,10,1\n", "line 2: slots must be a whole number"),
    ("zero slots", f"{HEADER}\n1,0,u,t,0,10,10,1\n", "slots must be >= 1"),
    ("zero duration", f"{HEADER}\n1,0,u,t,1,0,10,1\n", "duration_s must be > 0"),
    ("infinite", f"{HEADER}\n1,0,u,t,1,inf,10,1\n", "duration_s is not a finite number"),
    ("duplicate id", f"{HEADER}\n1,0,u,t,1,10,10,1\n1,5,u,t,1,10,10,1\n", "line 3: job_id 1 appears twice"),
    ("header only", f"{HEADER}\n", "has a header but no jobs"),
]


@pytest.mark.parametrize("desc,text,message", READ_ERRORS, ids=[c[0] for c in READ_ERRORS])
def test_read_trace_errors(desc, text, message):
    with pytest.raises(TraceError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_trace(io.StringIO(text), name="t.csv")


def test_read_trace_and_quotas():
    jobs = read_trace(io.StringIO(f"{HEADER}\n7, 1.5 ,ann,nlp,4,100,300,2\n"))
    assert jobs == [TraceJob(7, 1.5, "ann", "nlp", 4, 100.0, 300.0, 2)]
    assert read_quotas({"nlp": 8}) == {"nlp": 8}
    for bad in ([1], {"nlp": -1}, {"nlp": 1.5}, {"nlp": True}):
        with pytest.raises(TraceError):
            read_quotas(bad)


@pytest.mark.parametrize("slots,spn,shape", [(1, 8, (1, 1)), (8, 8, (1, 8)), (16, 8, (2, 8)), (64, 8, (8, 8)),
                                             (12, 8, (2, 6)), (20, 8, (3, 7)), (3, 2, (2, 2))])
def test_gang_shape(slots, spn, shape):
    assert gang_shape(slots, spn) == shape


def test_short_jobs_do_not_wait_behind_a_long_one_under_trainyard():
    # a 10 h job holds one of two nodes; a 2-node job then has to wait for it, and under fifo so
    # do the 20 short single-slot jobs submitted after it
    trace = [tj(1, 0, 8, 36000)] + [tj(30, 5, 16, 600)] + [tj(i, 10 + i, 1, 600) for i in range(2, 22)]
    cfg = dict(nodes=2, slots_per_node=8)
    fifo = simulate(trace, SimConfig(policy="fifo", **cfg))
    ty = simulate(trace, SimConfig(policy="trainyard", **cfg))
    for r in (fifo, ty):
        assert r["jobs"] == 22 and 0 < r["utilization"] <= 1
        assert r["p50_jct_s"] <= r["p99_jct_s"] and r["avg_jct_s"] >= 600
    # fifo: everyone waits for job 1 and then job 30; trainyard runs the short ones first
    assert ty["avg_jct_s"] < 0.5 * fifo["avg_jct_s"]
    assert simulate(trace, SimConfig(policy="trainyard", **cfg)) == ty  # deterministic


def test_jobs_larger_than_the_cluster_are_skipped():
    r = simulate([tj(1, 0, 1, 100), tj(2, 0, 64, 100)], SimConfig(nodes=2, slots_per_node=8))
    assert r["skipped_jobs"] == [2] and r["jobs"] == 1


def test_reclaim_in_the_simulator():
    # team a borrows the whole cluster with long jobs; team b then wants its quota (8 slots)
    trace = [tj(i, 0, 4, 20 * 3600, team="a") for i in range(1, 5)] + [tj(10, 3600, 8, 3600, team="b")]
    r = simulate(trace, SimConfig(policy="trainyard", nodes=2, slots_per_node=8, quotas={"a": 8, "b": 8}))
    assert r["preemptions"] == 2  # two 4-slot borrowers make room for b's 8-slot job
    # the victims ran 1 h: checkpoints every 10 min, so at most the 30 s exit was lost each
    assert 0 < r["lost_slot_s"] <= 2 * 4 * 30 + 1e-6
    assert r["teams"]["b"]["share_of_entitlement"] > 0.95
    fifo = simulate(trace, SimConfig(policy="fifo", nodes=2, slots_per_node=8, quotas={"a": 8, "b": 8}))
    assert fifo["preemptions"] == 0 and fifo["teams"]["b"]["share_of_entitlement"] < 0.1


def test_fair_share_converges():
    # team a floods the queue first; team b's jobs arrive a minute later. Both have equal
    # entitlements (8 slots each on 16); a FIFO serves a for hours before b gets anything.
    trace = [tj(i, 0, 1, 900, team="a") for i in range(1, 201)]
    trace += [tj(1000 + i, 60, 1, 900, team="b") for i in range(1, 201)]
    cfg = dict(nodes=2, slots_per_node=8)
    fifo = simulate(trace, SimConfig(policy="fifo", **cfg))
    ty = simulate(trace, SimConfig(policy="trainyard", **cfg))
    assert fifo["teams"]["b"]["share_of_entitlement"] < 0.6
    for team in ("a", "b"):
        assert ty["teams"][team]["share_of_entitlement"] >= 0.9
        assert ty["teams"][team]["entitlement_slots"] == 8


def test_unknown_policy_is_an_error():
    with pytest.raises(TraceError, match="unknown policy"):
        simulate([tj(1, 0, 1, 10)], SimConfig(policy="lottery"))


def test_decayed_usage():
    h = 3600.0
    # one slot for one half-life, just ended: integral of 2^-(a/h) over a in [0, h] = h / (2 ln 2)
    assert decayed_slot_seconds(1, 0, h, h, h) == pytest.approx(h / (2 * math.log(2)))
    # a running interval counts up to now; a finished one decays
    u = decayed_usage([("a", 2, 0, None), ("b", 1, 0, h), ("b", 1, -10 * h, -9 * h)], now=h, half_life_s=h)
    assert u["a"] == pytest.approx(2 * h / (2 * math.log(2)))
    assert u["b"] == pytest.approx(h / (2 * math.log(2)) * (1 + 2 ** -10))
    m = UsageMeter(h)
    m.advance(h / 2, {"a": 2})
    m.advance(h, {"a": 2})
    assert m.usage["a"] == pytest.approx(u["a"])


def _trace_file(tmp_path, text, name="trace.csv"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_simulate_command_json(tmp_path):
    rows = "\n".join(f"{i},{i * 10},u{i % 3},{'ab'[i % 2]},{1 + i % 4},{300 + 50 * i},{900 + 50 * i},1"
                     for i in range(1, 30))
    trace = _trace_file(tmp_path, f"{HEADER}\n{rows}\n")
    quotas = tmp_path / "q.json"
    quotas.write_text(json.dumps({"a": 6, "b": 10}))
    out, err = io.StringIO(), io.StringIO()
    call_command("simulate", "--trace", trace, "--policy", "backfill", "--nodes", "2", "--slots-per-node", "8",
                 "--quotas", str(quotas), "--json", stdout=out, stderr=err)
    doc = json.loads(out.getvalue())  # exactly one JSON document
    assert doc["policy"] == "backfill" and doc["jobs"] == 29
    assert {"avg_jct_s", "p50_jct_s", "p99_jct_s", "avg_wait_s", "makespan_s", "utilization", "preemptions",
            "teams"} <= set(doc)
    assert doc["teams"]["a"]["entitlement_slots"] == 6 and doc["teams"]["b"]["entitlement_slots"] == 10
    assert "simulating 29 jobs" in err.getvalue()
    out = io.StringIO()
    call_command("simulate", "--trace", trace, stdout=out, stderr=io.StringIO())
    assert "policy trainyard" in out.getvalue() and "avg_jct_s" in out.getvalue()


def test_simulate_command_errors(tmp_path):
    good = _trace_file(tmp_path, f"{HEADER}\n1,0,u,t,1,10,10,1\n")
    bad_json = tmp_path / "q.json"
    bad_json.write_text("{nope")
    cases = [
        (["--trace", str(tmp_path / "missing.csv")], "cannot read .*missing.csv: No such file"),
        (["--trace", _trace_file(tmp_path, "job_id,slots\n1,1\n", "bad.csv")], "lacks column"),
        (["--trace", good, "--policy", "sjf"], "unknown policy 'sjf'"),
        (["--trace", good, "--quotas", str(bad_json)], "q.json is not valid JSON"),
        (["--trace", good, "--quotas", str(tmp_path / "none.json")], "cannot read"),
        (["--trace", good, "--nodes", "0"], "at least 1"),
    ]
    for args, message in cases:
        with pytest.raises(CommandError, match=message):
            call_command("simulate", *args, stdout=io.StringIO(), stderr=io.StringIO())
