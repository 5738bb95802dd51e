"""jobs/attempts/policy/profiling.py: shares, classes with hysteresis, and each recommendation."""
from __future__ import annotations

import pytest

from jobs.attempts.policy import profiling as prof
from trainyard.spec import SpecError, parse_job_spec


def _spec(**over) -> dict:
    base = {"name": "p", "model": {"kind": "gpt", "layers": 2, "hidden": 256, "heads": 4, "seq_len": 64,
                                   "vocab": 256},
            "resources": {"nodes": 2, "procs_per_node": 1}, "train": {"steps": 100, "global_batch": 8}}
    for k, v in over.items():
        base[k] = {**base.get(k, {}), **v} if isinstance(v, dict) else v
    return parse_job_spec(base).to_json()


def _samples(*, data=0.001, compute=0.05, comm=0.0, exposed=0.0, optim=0.002, steps=range(3, 23), ranks=2,
             step_extra=0.0):
    """Samples whose step_s = data + compute + exposed comm + optim (+ extra)."""
    return [{"rank": r, "step": s, "data_s": data, "compute_s": compute, "comm_s": comm, "optim_s": optim,
             "step_s": data + compute + exposed + optim + step_extra} for s in steps for r in range(ranks)]


def _shares(comm=0.0, data=0.0) -> prof.Shares:
    return prof.Shares(compute=1 - comm - data, communication=comm, input=data, step_s=0.1, comm_s=comm * 0.1,
                       exposed_comm_s=comm * 0.1, data_s=data * 0.1, compute_s=(1 - comm - data) * 0.1, optim_s=0.0,
                       steps=20, ranks=2, from_step=3, to_step=22)


def test_shares_split_step_time_and_count_only_exposed_comm():
    # 30 ms of comm of which 20 ms exposed: the hidden 10 ms costs no step time
    s = prof.shares(_samples(data=0.01, compute=0.05, comm=0.03, exposed=0.02, optim=0.02))
    assert s.step_s == pytest.approx(0.1)
    assert (s.input, s.communication, s.compute) == pytest.approx((0.1, 0.2, 0.7))
    assert s.comm_s == pytest.approx(0.03) and s.exposed_comm_s == pytest.approx(0.02)
    assert (s.steps, s.ranks, s.from_step, s.to_step) == (20, 2, 3, 22)


def test_shares_leave_out_warmup_checkpoint_steps_and_need_enough_steps():
    rows = _samples(steps=range(1, 11))
    rows[0]["step_s"] = rows[1]["step_s"] = 5.0  # step 1 (warm-up) of both ranks: left out
    rows[-1]["step_s"] = 3.0  # a checkpoint save on rank 1: over OUTLIER x the median, left out
    s = prof.shares(rows)
    assert s.from_step == 3 and s.step_s == pytest.approx(0.053)
    assert prof.shares(_samples(steps=range(1, 7))) is None  # steps 3..6: 4 < MIN_STEPS
    # an attempt resumed from step 9 (first_step) warms up on steps 10 and 11
    assert prof.shares(_samples(steps=range(10, 17)), first_step=9).from_step == 12
    assert prof.shares(_samples(steps=range(10, 17)), first_step=10) is None


def test_shares_need_every_phase():
    rows = _samples()
    for r in rows:
        r["comm_s"] = None  # a script reporting only step_s and some phases
    assert prof.shares(rows) is None
    p = prof.profile(rows, {"entrypoint": {"script": "t.py"}, "comm": {}})
    assert p["class"] == prof.UNKNOWN and p["reason"].startswith("not enough telemetry")
    assert "run.phase" in p["reason"] and p["recommendation"] is None


def test_median_over_ranks_ignores_one_odd_rank():
    rows = _samples(ranks=3, comm=0.05, exposed=0.05)
    for r in rows:
        if r["rank"] == 2:  # one rank waits for data a lot
            r["data_s"] = 0.2
            r["step_s"] += 0.2 - 0.001
    s = prof.shares(rows)
    assert s.input < 0.05


@pytest.mark.parametrize(("comm", "data", "previous", "expected"), [
    (0.29, 0.0, None, "compute"), (0.30, 0.0, None, "communication"),
    (0.0, 0.19, None, "compute"), (0.0, 0.20, None, "input"),
    (0.20, 0.0, "communication", "communication"), (0.19, 0.0, "communication", "compute"),
    (0.0, 0.12, "input", "input"), (0.0, 0.11, "input", "compute"),
    (0.25, 0.0, "compute", "compute"),  # between the thresholds: stays where it was
    (0.45, 0.25, None, "communication"), (0.31, 0.42, None, "input"),
    (0.22, 0.15, "communication", "communication"),  # the other is below its enter threshold
    (0.21, 0.25, "communication", "input"),  # the other enters with a larger share
    (0.29, 0.25, "communication", "communication"),  # the other enters, but with a smaller share
])
def test_classify_thresholds(comm, data, previous, expected):
    assert prof.classify(_shares(comm, data), previous) == expected


def test_no_flapping_at_the_boundary():
    # a communication share wandering around the enter threshold changes class once, not each check
    classes, previous = [], None
    for comm in (0.26, 0.31, 0.28, 0.32, 0.23, 0.29, 0.21, 0.30, 0.24):
        previous = prof.classify(_shares(comm), previous)
        classes.append(previous)
    assert classes == ["compute"] + ["communication"] * 8
    changes = sum(a != b for a, b in zip(classes, classes[1:]))
    assert changes == 1
    assert prof.classify(_shares(0.19), "communication") == "compute"


def test_communication_bound_recommends_powersgd_with_the_predicted_gain():
    spec = _spec()
    # 60 ms step: 40 ms comm, 30 exposed (10 hidden under backward)
    p = prof.profile(_samples(data=0.001, compute=0.025, comm=0.04, exposed=0.03, optim=0.004), spec)
    assert p["class"] == "communication" and p["shares"]["communication"] == pytest.approx(0.5)
    rec = p["recommendation"]
    assert rec["kind"] == "compression" and rec["change"] == {"comm.compression": "powersgd"}  # rank 2 already
    assert rec["before"] == {"comm.compression": "none"}
    ratio = prof.powersgd_byte_ratio(spec["model"], 2)
    assert 0.01 < ratio < 0.1
    # new comm 40 ms x ratio fits within the 10 ms overlap window: the 30 ms exposed go away
    assert rec["predicted_step_s"] == pytest.approx(0.06 - 0.03)
    assert rec["predicted_gain"] == pytest.approx(1.0, abs=1e-3)
    assert "comm.compression powersgd" in rec["text"]
    prof.spec_with_change(spec, rec["change"])  # valid as a submit


def test_powersgd_ratio_matches_the_measured_test_gpt():
    # comm.py measured 0.054 for the 2-layer hidden-64 test GPT at rank 2
    model = {"kind": "gpt", "layers": 2, "hidden": 64, "heads": 2, "seq_len": 32, "vocab": 256}
    assert prof.powersgd_byte_ratio(model, 2) == pytest.approx(0.054, abs=0.006)


def test_communication_bound_under_compression_goes_further():
    spec = _spec(comm={"compression": "bf16"})
    rec = prof.profile(_samples(compute=0.02, comm=0.04, exposed=0.04), spec)["recommendation"]
    assert rec["change"]["comm.compression"] == "powersgd"
    spec = _spec(comm={"compression": "topk", "ratio": 0.01})  # 0.02 of the bytes: PowerSGD sends more
    rec = prof.profile(_samples(compute=0.02, comm=0.04, exposed=0.04), spec)["recommendation"]
    assert rec["change"] == {"comm.ratio": 0.0025}
    # 40 ms of comm, 2 x 2 ms of it top-k's arithmetic: a quarter of the rest + the arithmetic, no overlap
    assert rec["predicted_step_s"] == pytest.approx(0.023 + (0.04 - 0.004) / 4 + 0.004)


def test_compression_arithmetic_is_charged_in_units_of_the_optimizer_step():
    # the integration GPT on 2 loaded gloo CPU ranks (medians): PowerSGD's arithmetic (1.5 x the 88 ms
    # optimizer step) costs more than the 79 ms all-reduce it removes; local SGD wins
    rows = _samples(data=0.0001, compute=0.0635, comm=0.0794, exposed=0.065, optim=0.0878)
    rec = prof.profile(rows, _spec(model={"hidden": 512, "heads": 8, "seq_len": 16}, train={"global_batch": 2}))[
        "recommendation"]
    assert rec["change"] == {"comm.sync": "local_sgd"}  # the period is 4 already
    assert rec["predicted_step_s"] == pytest.approx(0.2164 - 0.065 + 0.0794 / 4, abs=1e-4)
    # the same job with a fast optimizer step (a GPU's fused kernels): PowerSGD
    rows = _samples(data=0.0001, compute=0.0635, comm=0.0794, exposed=0.065, optim=0.002)
    rec = prof.profile(rows, _spec(model={"hidden": 512, "heads": 8, "seq_len": 16}, train={"global_batch": 2}))[
        "recommendation"]
    assert rec["change"]["comm.compression"] == "powersgd"
    # under PowerSGD whose arithmetic is the whole comm time: local SGD (without compression) drops it
    rows = _samples(data=0.0001, compute=0.0635, comm=0.0794, exposed=0.065, optim=0.06)
    rec = prof.profile(rows, _spec(comm={"compression": "powersgd"}))["recommendation"]
    assert rec["change"] == {"comm.sync": "local_sgd", "comm.compression": "none"}
    assert rec["before"] == {"comm.sync": "allreduce", "comm.compression": "powersgd"}


def test_communication_bound_with_local_sgd_doubles_the_period():
    spec = _spec(comm={"sync": "local_sgd", "period": 4})
    rec = prof.profile(_samples(compute=0.02, comm=0.04, exposed=0.04), spec)["recommendation"]
    assert rec["kind"] == "local_sgd" and rec["change"] == {"comm.period": 8}
    assert rec["predicted_step_s"] == pytest.approx(0.063 - 0.02)


def test_communication_bound_without_a_valid_change_says_so():
    spec = _spec(parallel={"tp": 2, "dp": 1}, model={"heads": 4},  # compression needs plain DDP
                 resources={"nodes": 1, "procs_per_node": 2})
    p = prof.profile(_samples(compute=0.02, comm=0.04, exposed=0.04), spec)
    assert p["class"] == "communication"
    rec = p["recommendation"]
    assert rec["kind"] == "another_plan" and rec["change"] is None and "plain data parallelism" in rec["text"]


def test_input_bound_names_the_cause_without_a_change():
    p = prof.profile(_samples(data=0.03, compute=0.05), _spec())
    assert p["class"] == "input" and p["shares"]["input"] == pytest.approx(0.03 / 0.082, abs=1e-3)
    rec = p["recommendation"]
    assert rec["kind"] == "loader" and rec["change"] is None
    assert rec["predicted_step_s"] == pytest.approx(0.052)
    user = prof.profile(_samples(data=0.03, compute=0.05), {"entrypoint": {"script": "t.py"}, "comm": {}})
    assert "num_workers" in user["recommendation"]["text"]


def test_compute_under_used_recommends_a_larger_micro_batch():
    # 8 samples over dp 2 x grad_accum 4: micro-batches of 1 x 16 tokens on hidden 64 (cpu)
    spec = _spec(model={"hidden": 64, "seq_len": 16}, train={"grad_accum": 4})
    p = prof.profile(_samples(compute=0.05), spec)
    assert p["class"] == "compute"
    rec = p["recommendation"]
    assert rec["kind"] == "larger_micro_batch" and rec["change"] == {"train.grad_accum": 2}
    now = prof.matmul_eff("cpu", (16 * 64 * 64) ** (1 / 3))
    new = prof.matmul_eff("cpu", (32 * 64 * 64) ** (1 / 3))
    assert rec["predicted_step_s"] == pytest.approx(0.053 - 0.05 * (1 - now / new), rel=1e-4)
    assert rec["predicted_gain"] > prof.MIN_GAIN


def test_compute_bound_with_big_matrices_changes_nothing():
    spec = _spec(model={"hidden": 512, "heads": 8}, train={"grad_accum": 2})
    rec = prof.profile(_samples(compute=0.05), spec)["recommendation"]
    assert rec["kind"] == "none" and rec["change"] is None and rec["predicted_gain"] == 0


def test_matmul_eff_interpolates_and_clamps():
    assert prof.matmul_eff("cpu", 4) == prof.MATMUL_EFF["cpu"][0][1]
    assert prof.matmul_eff("cpu", 10_000) == 1.0
    assert prof.matmul_eff("cpu", 32) == pytest.approx(0.21)
    assert 0.21 < prof.matmul_eff("cpu", 45) < 0.65


def test_spec_with_change_validates_like_a_submit():
    spec = _spec(parallel={"tp": 2, "dp": 1}, resources={"nodes": 1, "procs_per_node": 2})
    with pytest.raises(SpecError) as e:
        prof.spec_with_change(spec, {"comm.compression": "powersgd"})
    assert "comm.compression" in e.value.errors
    with pytest.raises(SpecError):
        prof.spec_with_change(spec, {})
    out = prof.spec_with_change(_spec(), {"comm.compression": "bf16"})
    assert out.comm.compression == "bf16"


def test_a_change_that_measured_slower_is_reverted_and_not_offered_again():
    spec = _spec(comm={"sync": "local_sgd", "period": 4})
    rows = _samples(compute=0.02, comm=0.04, exposed=0.04)  # communication-bound under local SGD: 63 ms
    slower = {"before": {"comm.sync": "allreduce"}, "after": {"comm.sync": "local_sgd"}, "step_s_before": 0.05,
              "step_s_after": 0.063, "measured_gain": -0.206, "recommendation": "local_sgd"}
    rec = prof.profile(rows, spec, results=[slower])["recommendation"]
    assert rec["kind"] == "revert" and rec["change"] == {"comm.sync": "allreduce"}
    assert rec["before"] == {"comm.sync": "local_sgd"} and rec["predicted_step_s"] == pytest.approx(0.05)
    assert "made the step slower (63.0 ms against 50.0 ms before it): set comm.sync allreduce again" in rec["text"]
    # reverted: the model would offer local SGD again, but it measured slower here
    reverted = {"before": {"comm.sync": "local_sgd"}, "after": {"comm.sync": "allreduce"}, "step_s_before": 0.063,
                "step_s_after": 0.07, "measured_gain": -0.1, "recommendation": "revert"}
    spec = _spec()
    rows = _samples(data=0.0001, compute=0.0635, comm=0.0794, exposed=0.065, optim=0.0878)
    assert prof.profile(rows, spec)["recommendation"]["change"] == {"comm.sync": "local_sgd"}
    rec = prof.profile(rows, spec, results=[slower, reverted])["recommendation"]
    assert rec["kind"] == "none" and rec["change"] is None and "not offered again" in rec["text"]
    # a revert that measured slower is not undone (no ping-pong)
    rec = prof.profile(rows, spec, results=[reverted])["recommendation"]
    assert rec["kind"] != "revert"


def test_achieved_tflops_counts_the_rank_share_over_its_compute_time():
    spec = _spec()  # gpt 2 layers hidden 256 seq 64, global batch 8 over 2 ranks
    p = prof.profile(_samples(compute=0.05), spec)
    params = prof.param_count("gpt", layers=2, hidden=256, seq_len=64, vocab=256)
    assert p["achieved_tflops"] == pytest.approx(6 * params * 4 * 64 / 0.05 / 1e12, rel=1e-4)
    user = parse_job_spec({"name": "u", "entrypoint": {"script": "/opt/train.py"}}).to_json()
    p = prof.profile(_samples(), user)  # a script reporting every phase: profiled, the model is its own
    assert p["class"] == "compute" and p["achieved_tflops"] is None and p["recommendation"]["change"] is None
    p = prof.profile(_samples(comm=0.05, exposed=0.05), user)
    assert p["class"] == "communication" and p["recommendation"]["change"] is None
    assert "DDP comm hook" in p["recommendation"]["text"]


def test_a_user_model_trained_through_run_prepare_gets_a_comm_change_it_can_apply():
    user = parse_job_spec({"name": "u", "entrypoint": {"script": "/opt/train.py"}, "train": {"global_batch": 8},
                           "resources": {"nodes": 2, "procs_per_node": 1}}).to_json()
    rows = _samples(data=0.001, compute=0.025, comm=0.04, exposed=0.03, optim=0.004)
    described = {"kind": "user", "layers": 2, "hidden": 256, "heads": 4, "seq_len": 64, "vocab": 256,
                 "params": 2_000_000}
    rec = prof.profile(rows, user, model=described)["recommendation"]
    assert rec["kind"] == "compression" and rec["change"] == {"comm.compression": "powersgd"}
    # priced as the built-in transformer of that shape
    assert rec["predicted_step_s"] == pytest.approx(prof.profile(rows, _spec())["recommendation"]["predicted_step_s"])
    assert prof.spec_with_change(user, rec["change"]).comm.compression == "powersgd"  # valid as a submit
    without = prof.profile(rows, user)["recommendation"]  # no run.prepare: nothing the spec can change
    assert without["change"] is None and "run.prepare" in without["text"]
    bare = prof.profile(rows, user, model={k: v for k, v in described.items() if k not in ("vocab", "seq_len")})
    assert bare["recommendation"]["change"]  # no vocabulary or sequence length seen: still priced
