"""comm.sync local_sgd and hierarchical: real torchrun, gloo, a real redis-server.

local_sgd, 2 ranks, period 2, start_step 3: steps 1-3 all-reduce gradients (replicas equal),
then gradients stay local and the models are averaged after steps 4, 6, 8 (torch's
PeriodicModelAverager counts from 0: s-1 >= 3 and (s-1-3) % 2 == 0). Every sample's
params_checksum (float64 sum of that rank's parameters) shows the replicas diverge after 5 and
7 and are equal right after every averaging; bytes_sent is 0 on the local steps and the
parameter bytes on averaging steps. Resuming from the step-4 checkpoint keeps the schedule.

hierarchical, 4 ranks as resources 2 nodes x 2, periods node 2 global 4, start_step 2:
node-level averaging after steps 3 and 7 (ranks {0,1} and {2,3} agree, the nodes differ), global
after 5 and 9 (all agree).
"""
from pathlib import Path

import pytest

from trainyard.spec import SpecError, parse_job_spec

from .conftest import SMALL_MODEL
from .test_torchrun import run_job


def _hierarchical(periods):
    return parse_job_spec({"name": "x", "comm": {"sync": "hierarchical", "periods": periods},
                           "resources": {"nodes": 2, "procs_per_node": 2}})


# comm.periods is checked by the JobSpec (trainyard/spec.py), at submit and for the launch config
@pytest.mark.parametrize("raw, field", [
    ({"node": 4, "global": 4}, "comm.periods.global"),
    ({"node": 0, "global": 4}, "comm.periods.node"),
    ({"node": 2, "global": True}, "comm.periods.global"),
    ({"node": 2, "global": 8, "every": 1}, "comm.periods.every"),
])
def test_bad_periods_are_refused_naming_the_field(raw, field):
    with pytest.raises(SpecError) as e:
        _hierarchical(raw)
    assert field in e.value.errors


def test_periods_in_order():
    periods = _hierarchical({"node": 2, "global": 8}).comm.periods
    assert (periods.node, periods.global_) == (2, 8)


def _run(tmp_path: Path, url: str, env: dict, name: str, job_id: int, *, nproc=2, resume=None,
         steps=8, **sections):
    samples, events, text = run_job(tmp_path, url, env, name, job_id, resume=resume, nproc=nproc,
                                    model=SMALL_MODEL, train={"steps": steps, "global_batch": 16}, **sections)
    return {(s["rank"], s["step"]): s for s in samples}, events, text


@pytest.mark.procs
def test_local_sgd_averages_every_period_and_sends_nothing_in_between(tmp_path, redis_server, repo_env):
    url = redis_server.url
    comm = {"sync": "local_sgd", "period": 2, "start_step": 3}
    samples, events, text = _run(tmp_path, url, repo_env, "lsgd", 21, comm=comm,
                                 checkpoint={"every_steps": 4, "async": True, "keep": 3})
    assert sorted(samples) == [(r, s) for r in (0, 1) for s in range(1, 9)]  # one sample a step
    [plan] = [e for e in events if e["kind"] == "rank_plan" and e["rank"] == 0]
    param_bytes = plan["param_bytes"]
    started = [e for e in events if e["kind"] == "local_sgd_started"]
    assert [(e["rank"], e["step"], e["period"]) for e in started] == [(0, 4, 2)]

    def both(step, key):
        return samples[(0, step)][key], samples[(1, step)][key]

    for step in (1, 2, 3):  # dense gradient all-reduce: identical replicas, gradient bytes
        c0, c1 = both(step, "params_checksum")
        assert c0 == c1, step
        assert both(step, "bytes_sent") == (param_bytes, param_bytes)
        assert both(step, "averaged") == (None, None)
    for step in (4, 6, 8):  # averaged after the local update: equal again, parameters sent
        c0, c1 = both(step, "params_checksum")
        assert c0 == c1, (step, c0, c1)
        assert both(step, "bytes_sent") == (param_bytes, param_bytes)
        assert both(step, "averaged") == ("global", "global")
        assert min(both(step, "comm_s")) > 0
    for step in (5, 7):  # local steps: nothing sent, the replicas drift apart
        c0, c1 = both(step, "params_checksum")
        assert c0 != c1, step
        assert both(step, "bytes_sent") == (0, 0)
        assert both(step, "averaged") == (None, None)
    for s in samples.values():
        assert s["data_s"] + s["compute_s"] + s["optim_s"] <= s["step_s"] * 1.001, s
        assert s["optim_s"] >= 0
    losses = [samples[(0, s)]["loss"] for s in range(1, 9)]
    assert losses[-1] < losses[0]

    # resume from the step-4 checkpoint (PostLocalSGDOptimizer state via get_state_dict): the
    # replicas were averaged at step 4, so the model is restored exactly on both ranks. The AdamW
    # moments differ per replica and DCP stores one copy of each replicated tensor (from one
    # rank, its pick), so the run continues from equal replicas with those moments: the same
    # schedule and bytes, the same step-5 losses, not a bitwise replay afterwards.
    [c4] = [e for e in events if e["kind"] == "checkpoint" and e["step"] == 4]
    resumed, revents, text = _run(tmp_path, url, repo_env, "lsgd-resumed", 21, comm=comm,
                                  checkpoint={"every_steps": 4, "async": True, "keep": 3},
                                  resume={"path": c4["path"], "step": 4, "checkpoint_id": 1})
    assert "rank 0 resumed from step 4" in text
    after = {k: v for k, v in resumed.items() if v["attempt"] == 10}
    assert sorted(after) == [(r, s) for r in (0, 1) for s in range(5, 9)]
    for rank in (0, 1):
        assert after[(rank, 5)]["loss"] == samples[(rank, 5)]["loss"]  # forward before the update
        assert after[(rank, 8)]["loss"] == pytest.approx(samples[(rank, 8)]["loss"], rel=0.02)
    for (rank, step), s in after.items():
        assert (s["bytes_sent"], s["averaged"]) == (samples[(rank, step)]["bytes_sent"],
                                                   samples[(rank, step)]["averaged"])
    for step in (6, 8):
        assert after[(0, step)]["params_checksum"] == after[(1, step)]["params_checksum"]
    assert after[(0, 7)]["params_checksum"] != after[(1, 7)]["params_checksum"]
    assert [e["step"] for e in revents if e["kind"] == "local_sgd_started" and e["attempt"] == 10] == [5]


@pytest.mark.procs
def test_hierarchical_averages_within_nodes_then_globally(tmp_path, redis_server, repo_env):
    samples, events, text = _run(
        tmp_path, redis_server.url, repo_env, "hier", 22, nproc=4, steps=9,
        resources={"nodes": 2, "procs_per_node": 2, "device": "cpu"},
        parallel={"dp": 4, "tp": 1, "pp": 1, "fsdp": False, "microbatches": 4, "schedule": "1f1b"},
        comm={"sync": "hierarchical", "periods": {"node": 2, "global": 4}, "start_step": 2})
    assert sorted(samples) == [(r, s) for r in range(4) for s in range(1, 10)]
    [plan] = [e for e in events if e["kind"] == "rank_plan" and e["rank"] == 0]
    param_bytes = plan["param_bytes"]

    def col(step, key):
        return [samples[(r, step)][key] for r in range(4)]

    for step in (1, 2, 5, 9):  # dense gradients (1, 2) or global averaging (5, 9)
        c = col(step, "params_checksum")
        assert len(set(c)) == 1, (step, c)
        assert col(step, "bytes_sent") == [param_bytes] * 4
    assert col(5, "averaged") == col(9, "averaged") == ["global"] * 4
    for step in (3, 7):  # within a node: {0,1} and {2,3} agree, the nodes differ
        c = col(step, "params_checksum")
        assert c[0] == c[1] and c[2] == c[3] and c[0] != c[2], (step, c)
        assert col(step, "averaged") == ["node"] * 4
        assert col(step, "bytes_sent") == [param_bytes] * 4
    for step in (4, 6, 8):  # local steps
        c = col(step, "params_checksum")
        assert len(set(c)) == 4, (step, c)
        assert col(step, "bytes_sent") == [0] * 4 and col(step, "averaged") == [None] * 4
    [started] = [e for e in events if e["kind"] == "local_sgd_started"]
    assert started["step"] == 3 and started["periods"] == {"node": 2, "global": 4}
