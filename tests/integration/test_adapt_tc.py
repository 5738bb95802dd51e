"""Issue 24 section 1, a sustained bottleneck end to end: two test hosts (tests/integration/hosts.py,
test_multihost.py's fixtures) whose links are slowed with a tc token bucket (as bench/netns.py
does) train a 2-node `adapt: auto` GPT whose gradient all-reduce then bounds the step. The profiler
calls it communication-bound; once that holds for tuning.SUSTAIN_STEPS steps the control plane arms
the recommended change by itself, applies it at the next checkpoint (the job resumes from it with
the change), measures the same window on the next attempt and:

- keeps it when the step got faster (the same link: less to send);
- and the next job of that shape starts with the kept change (the knowledge base);
- reverts it when the step measured slower. A compressed step is slower than the dense one only on
  a link about 12x slower, so the test makes the link that much slower the moment the change is
  applied (as a link that degrades at that moment would), while the next attempt starts; the
  control plane measures the slower step, arms the revert, and restores the old values at the next
  checkpoint; the link is given back its rate once the revert is armed, so the dense steps after it
  do not crawl. This kernel has no netem, so the test cannot add delay instead of rate.

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
    """A token bucket of `rate` on both training hosts' links (each direction out of a host), in
    place of the one there, if any."""
    for i, name in enumerate(net.names):
        if name.startswith("gpu-"):
            subprocess.run(net.exec_argv(name, ["tc", "qdisc", "replace", "dev", f"ty{net.uid}h{i}", "root", "tbf",
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


# Another shape than JOB's (3 layers): the kept outcome above must not start this job compressed.
SLOWER = {**JOB, "model": {**JOB["model"], "layers": 3}}
# While the next attempt starts, 1 mbit: its start broadcasts the dense parameters (~4.5 MB) once.
# From its first step, 0.4 mbit: 100x slower than RATE, where PowerSGD's fraction of the bytes takes
# about twice as long as the dense step did at RATE.
RESTART, DEGRADED = "1mbit", "400kbit"


def first_sample(cluster, jid: int, number: int):
    attempt = next((a for a in cluster.job(jid)["attempts"] if a["number"] == number), None)
    return attempt and cluster.get(f"/api/v1/jobs/{jid}/metrics/?attempt={attempt['id']}&limit=1")


def test_a_change_that_measured_slower_is_reverted_and_not_offered_again(cluster, net):
    shape(net, RATE)
    jid = cluster.submit({**SLOWER, "name": "tc-revert"})["id"]
    try:
        cluster.wait_for(lambda: events(cluster, jid, "adapted"), 300, "the adapted event", interval_s=0.1,
                         job_id=jid)
        shape(net, RESTART)
        cluster.wait_for(lambda: first_sample(cluster, jid, 2), 300, "the next attempt's first step",
                         interval_s=0.1, job_id=jid)
        shape(net, DEGRADED)  # before its first measured step: the profile leaves out the first 2
        reverting = wait_event(cluster, jid, "adapt_reverting", 400)
    finally:
        shape(net, RATE)
    applied = events(cluster, jid, "adapted")[0]
    print("adapted:", applied["message"])
    assert applied["data"]["cause"] == "bottleneck"
    print("measured:", events(cluster, jid, "recommendation_result")[0]["message"])
    print("reverting:", reverting["message"])
    r = reverting["data"]
    assert r["measured_gain"] < 0 and r["step_s_after"] > r["step_s_before"]
    reverted = wait_event(cluster, jid, "adapt_reverted", 300)
    print("reverted:", reverted["message"])
    job = cluster.job(jid)
    [entry] = job["adaptations"]
    assert entry["kind"] == "bottleneck" and entry["outcome"] == "reverted" and entry["measured_gain"] < 0
    for path, value in applied["data"]["before"].items():  # the old values are back in the spec
        section, key = path.split(".")
        assert job["spec"].get(section, {}).get(key, value) == value, (path, job["spec"].get(section))
    # the attempt after the revert trains with the old values, and its profile never offers the change again
    change = applied["data"]["after"]
    last = cluster.wait_for(lambda: (a := cluster.job(jid)["attempts"][-1])["number"] >= 3
                            and (a.get("profile") or {}).get("shares") and a, 300, "the reverted attempt's profile",
                            interval_s=1.0, job_id=jid)
    rec = last["profile"].get("recommendation") or {}
    print("profile after the revert:", last["profile"]["class"], rec.get("text"))
    assert rec.get("change") != change
    cancel(cluster, jid)
