"""Elastic node counts in the trace simulator (issue 24, section 2): the real policy decides; the
simulator runs an elastic job on fewer nodes at k / N speed, grows it (a resize keeps its work
and costs a restart), shrinks a borrower for reclaim, and reports JCT and utilisation of the
elastic trace against the same trace at fixed sizes."""
import io
import json

import pytest
from django.core.management import call_command

from jobs.scheduling.simulation import SimConfig, TraceError, TraceJob, read_trace, simulate

HEADER = "job_id,submit_s,user,team,slots,duration_s,estimate_s,priority"


def tj(id, submit, slots, duration, team="a", min_slots=None):
    return TraceJob(id, submit, f"{team}-u", team, slots, duration, duration, 1, min_slots)


def test_starts_on_the_free_node_and_grows_when_the_long_job_ends():
    # a 3-node job runs 5000 s; the elastic 4-node job (2000 s on 4) would wait 5000 s fixed.
    # Elastic: one node from t=1 (a quarter speed), grown to 4 at 5000 s (+ the resize cost).
    trace = [tj(1, 0, 24, 5000), tj(2, 1, 32, 2000, min_slots=8)]
    cfg = dict(nodes=4, slots_per_node=8, quotas={"a": 32}, resize_cost_s=30.0)
    fixed = simulate(trace, SimConfig(elastic=False, **cfg))
    elastic = simulate(trace, SimConfig(**cfg))
    assert fixed["resizes"] == 0 and fixed["makespan_s"] == 7000.0
    assert elastic["resizes"] == 1 and elastic["elastic_jobs"] == 1
    # by 5000 s (+30 s exit) it did 5029 s at 1/4 speed; the rest of 2000 s on all 4 nodes, +30 s restart
    done = 5029.0 / 4
    assert elastic["makespan_s"] == pytest.approx(5030 + 30 + 2000 - done, abs=1.0)
    assert elastic["avg_jct_s"] < fixed["avg_jct_s"] and elastic["utilization"] > fixed["utilization"]


def test_waits_for_all_its_nodes_when_they_free_soon():
    trace = [tj(1, 0, 24, 100), tj(2, 1, 32, 2000, min_slots=8)]
    r = simulate(trace, SimConfig(nodes=4, slots_per_node=8, quotas={"a": 32}))
    assert r["resizes"] == 0 and r["makespan_s"] == pytest.approx(2100, abs=1)


def test_reclaim_shrinks_the_elastic_borrower_without_losing_work():
    # team a's elastic job borrows all 4 nodes; team b wants its 2-node quota
    trace = [tj(1, 0, 32, 20 * 3600, min_slots=8), tj(2, 3600, 16, 3600, team="b")]
    cfg = dict(nodes=4, slots_per_node=8, quotas={"a": 16, "b": 16})
    r = simulate(trace, SimConfig(**cfg))
    assert r["resizes"] >= 1 and r["preemptions"] == 0 and r["lost_slot_s"] == 0
    assert r["teams"]["b"]["share_of_entitlement"] > 0.95
    fixed = simulate(trace, SimConfig(elastic=False, **cfg))
    assert fixed["preemptions"] == 1 and fixed["lost_slot_s"] > 0


def test_min_slots_column_is_optional_and_checked():
    jobs = read_trace(io.StringIO(f"{HEADER},min_slots\n1,0,u,t,16,10,10,1,8\n2,0,u,t,1,10,10,1,\n"))
    assert [j.min_slots for j in jobs] == [8, None]
    assert read_trace(io.StringIO(f"{HEADER}\n1,0,u,t,16,10,10,1\n"))[0].min_slots is None
    with pytest.raises(TraceError, match="line 2: min_slots .4. must not exceed slots .2."):
        read_trace(io.StringIO(f"{HEADER},min_slots\n1,0,u,t,2,10,10,1,4\n"))


def test_simulate_command_elastic_against_fixed(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text(f"{HEADER},min_slots\n1,0,u,a,24,5000,5000,1,\n2,1,u,a,32,2000,2000,1,8\n")
    got = {}
    for flag in ((), ("--fixed",)):
        out = io.StringIO()
        call_command("simulate", "--trace", str(trace), "--nodes", "4", "--json", *flag, stdout=out,
                     stderr=io.StringIO())
        got[bool(flag)] = json.loads(out.getvalue())
    assert got[False]["elastic_jobs"] == 1 and got[True]["elastic_jobs"] == 0
    assert got[False]["avg_jct_s"] < got[True]["avg_jct_s"]
