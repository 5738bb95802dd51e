"""Issue 24 section 1, a sustained bottleneck end to end: two test hosts (tests/integration/hosts.py,
test_multihost.py's fixtures) whose links are slowed with a tc token bucket (as bench/netns.py
does) train a 2-node `adapt: auto` GPT whose gradient all-reduce then bounds the step. The profiler
calls it communication-bound; once that holds for tuning.SUSTAIN_STEPS steps the control plane arms
the recommended change by itself, applies it at the next checkpoint (the job resumes from it with
the change), measures the same window on the next attempt and:

- keeps it when the step got faster (the same link: less to send);
- and the next job of that shape starts with the kept change (the knowledge base).

The revert of a change that measured slower is tested through the services (tests/jobs/attempts/
test_tuning.py), not here: making PowerSGD slower than the dense step it replaced takes a link ~80x
slower, over which the restart's dense parameter broadcast and PowerSGD's dense warm-up steps outlast
the hang timeout, and this kernel has no netem for a delay instead.

Each step is a timeline event and a Job.adaptations entry with the evidence, the change, the
predicted and the measured effect; the outcome goes to the knowledge base.
"""
from __future__ import annotations

import subprocess

import pytest

from . import hosts
from . import test_multihost

ok, why = hosts.available()
pytestmark = [pytest.mark.procs, pytest.mark.timeout(900),
              pytest.mark.skipif(not ok, reason=f"network namespaces unavailable: {why}")]
net, cluster = test_multihost.net, test_multihost.cluster  # the same hosts and cluster fixtures
RATE = "40mbit"
JOB = {"model": {"kind": "gpt", "layers": 2, "hidden": 128, "heads": 4, "seq_len": 32, "vocab": 4096},
       "data": {"kind": "synthetic"}, "train": {"steps": 400, "global_batch": 8},
       "resources": {"nodes": 2, "procs_per_node": 1}, "checkpoint": {"every_steps": 10},
       "adapt": "auto", "adapt_max": 1}


def shape(net: hosts.Hosts, rate: str) -> None:
    """A token bucket of `rate` on both training hosts' links (each direction out of a host)."""
    for i, name in enumerate(net.names):
        if name.startswith("gpu-"):
            subprocess.run(net.exec_argv(name, ["tc", "qdisc", "add", "dev", f"ty{net.uid}h{i}", "root", "tbf",
                                                "rate", rate, "burst", "32kbit", "latency", "100ms"]),
                           check=True, capture_output=True)


def events(cluster, jid: int, kind: str) -> list[dict]:
    rows = cluster.get(f"/api/v1/jobs/{jid}/events/?page_size=500")["results"]
    return sorted((e for e in rows if e["kind"] == kind), key=lambda e: e["id"])


def wait_event(cluster, jid: int, kind: str, timeout_s: float) -> dict:
    cluster.wait_for(lambda: events(cluster, jid, kind), timeout_s, f"a {kind} event", interval_s=1.0, job_id=jid)
    return events(cluster, jid, kind)[0]


def cancel(cluster, jid: int) -> None:
    cluster.request("POST", f"/api/v1/jobs/{jid}/cancel/")
    cluster.wait_status(jid, {"CANCELLED", "SUCCEEDED", "FAILED"}, 120)


def test_a_comm_bound_job_is_adapted_and_the_change_kept(cluster, net):
    shape(net, RATE)
    jid = cluster.submit({**JOB, "name": "tc-keep"})["id"]
    applied = wait_event(cluster, jid, "adapted", 300)
    d = applied["data"]
    print("adapted:", applied["message"])
    assert d["cause"] == "bottleneck" and d["profile_class"] == "communication"
    assert d["evidence"]["shares"]["communication"] >= 0.3 and d["predicted_gain"] > 0
    kept = wait_event(cluster, jid, "adapt_kept", 300)
    print("kept:", kept["message"])
    assert kept["data"]["measured_gain"] > 0 and kept["data"]["step_s_after"] < kept["data"]["step_s_before"]
    job = cluster.job(jid)
    [entry] = job["adaptations"]
    assert entry["kind"] == "bottleneck" and entry["outcome"] == "kept" and entry["measured_gain"] > 0
    for path, value in d["after"].items():
        section, key = path.split(".")
        assert job["spec"][section][key] == value
    cancel(cluster, jid)


def test_the_next_job_of_that_shape_starts_from_what_worked(cluster, net):
    jid = cluster.submit({**JOB, "name": "tc-next"})["id"]
    [started] = events(cluster, jid, "adapted")  # at submit, from the knowledge base
    print("next job:", started["message"])
    assert started["data"]["cause"] == "knowledge" and started["data"]["measured_gain"] > 0
    assert cluster.job(jid)["spec"]["comm"]["compression"] == started["data"]["change"]["comm.compression"]
    cancel(cluster, jid)
