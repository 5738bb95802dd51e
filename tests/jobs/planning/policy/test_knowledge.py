"""The knowledge base's pure part (jobs/planning/policy/knowledge.py): what an attempt's samples say
(warm-step median of the slowest rank, peak memory), the record's fields, the nearest-record
ranking and the best plan per shape and cluster; and the predictor's use of the records."""
import math

import pytest

from jobs.planning.policy import knowledge
from jobs.planning.policy.predictor import STARTUP_S, JobShape, MeasuredStep, PastRun, estimate_step_s, predict
from trainyard.mesh import param_count

SPEC = {"model": {"kind": "gpt", "layers": 4, "hidden": 128, "heads": 4, "seq_len": 128, "vocab": 256},
        "train": {"global_batch": 32, "grad_accum": 1, "steps": 20},
        "resources": {"nodes": 2, "procs_per_node": 1, "device": "cpu"},
        "parallel": {"dp": 2, "tp": 1, "pp": 1, "fsdp": False, "microbatches": 4, "schedule": "1f1b"},
        "entrypoint": None}


def samples(step_times: dict[int, list[float]], mem=None):
    """{step: [rank0 step_s, rank1 step_s, ...]} -> sample dicts."""
    out = []
    for step, times in step_times.items():
        for rank, t in enumerate(times):
            out.append({"rank": rank, "step": step, "step_s": t, "tokens_per_s": 100.0 / t,
                        "mem_bytes": (mem or {}).get((step, rank), 1000)})
    return out


def test_measure_skips_the_first_three_steps_and_takes_the_slowest_rank_per_step():
    # steps 1-3 are slow warm-up; per step the job waits for its slowest rank
    s = samples({1: [9.0, 9.0], 2: [5.0, 4.0], 3: [3.0, 3.0], 4: [0.10, 0.30], 5: [0.20, 0.11],
                 6: [0.25, 0.12], 7: [0.12, 0.40], 8: [0.21, 0.22]})
    m = knowledge.measure(s)
    assert m.warm_steps == 5
    assert m.step_time_s == pytest.approx(0.25)  # median of 0.30, 0.20, 0.25, 0.40, 0.22


def test_measure_needs_five_warm_steps():
    assert knowledge.measure(samples({i: [0.1, 0.1] for i in range(1, 8)})) is None  # 4 warm steps
    assert knowledge.measure(samples({i: [0.1, 0.1] for i in range(1, 9)})).warm_steps == 5
    # steps without a step time do not count
    s = samples({i: [0.1] for i in range(1, 9)})
    s[-1]["step_s"] = None
    assert knowledge.measure(s) is None


def test_measure_counts_steps_from_where_the_attempt_started_and_peak_memory_over_everything():
    # a resumed attempt reports from step 101; its first three are its warm-up, whatever their number
    mem = {(101, 1): 7_000, (106, 0): 5_000}
    m = knowledge.measure(samples({s: [0.5, 0.5] if s > 103 else [2.0, 2.0] for s in range(101, 109)}, mem))
    assert m.step_time_s == 0.5 and m.warm_steps == 5
    assert m.mem_bytes == 7_000  # the peak of any rank at any step, warm-up included


def test_extract_a_built_in_job():
    rec = knowledge.extract(SPEC, {"planner": {"step_time_s": 0.2, "memory_gb_per_device": 0.5}},
                            samples({s: [0.25, 0.2] for s in range(1, 11)}), device_name="cpu")
    params = param_count("gpt", layers=4, hidden=128, seq_len=128, vocab=256)
    assert rec["params"] == params == 875_264
    assert rec["step_time_s"] == 0.25 and rec["warm_steps"] == 7 and rec["mem_bytes"] == 1000
    assert rec["tokens_per_s"] == pytest.approx(32 * 128 / 0.25)
    assert rec["tflops_per_device"] == pytest.approx(6 * params * 32 * 128 / 0.25 / 2 / 1e12)
    assert {k: rec[k] for k in knowledge.PLAN_FIELDS} == {
        "dp": 2, "tp": 1, "pp": 1, "micro_batch": 16, "fsdp": False, "shard_optimizer": False,
        "recompute": "none", "schedule": "1f1b"}
    assert rec["predicted_step_time_s"] == 0.2 and rec["predicted_memory_gb"] == 0.5
    assert rec["nodes"] == 2 and rec["procs_per_node"] == 1 and rec["device_name"] == "cpu"


def test_plan_fields_micro_batch_recompute_and_what_auto_resolved_to():
    pp = {**SPEC, "parallel": {"dp": 1, "tp": 1, "pp": 2, "fsdp": False, "microbatches": 4, "schedule": "gpipe",
                               "recompute": "full", "shard_optimizer": False}}
    assert knowledge.plan_fields(pp, {}) == {"dp": 1, "tp": 1, "pp": 2, "micro_batch": 8, "fsdp": False,
                                             "shard_optimizer": False, "recompute": "full", "schedule": "gpipe"}
    accum = {**SPEC, "train": {"global_batch": 32, "grad_accum": 4}}
    assert knowledge.plan_fields(accum, {})["micro_batch"] == 4
    # parallel: auto: the stored plan says what it became (the planner's own micro_batch wins)
    auto = {**SPEC, "parallel": "auto"}
    got = knowledge.plan_fields(auto, {"dp": 1, "tp": 2, "pp": 1, "fsdp": False, "micro_batch": 8,
                                       "shard_optimizer": True, "recompute": "full"})
    assert got == {"dp": 1, "tp": 2, "pp": 1, "micro_batch": 8, "fsdp": False, "shard_optimizer": True,
                   "recompute": "full", "schedule": "1f1b"}
    # full recompute: the hardware runs the forward twice, 8 instead of 6 x params x tokens
    rec = knowledge.extract(pp, {}, samples({s: [0.5] for s in range(1, 9)}), device_name="cpu")
    params = param_count("gpt", layers=4, hidden=128, seq_len=128, vocab=256)
    assert rec["tflops_per_device"] == pytest.approx(8 * params * 32 * 128 / 0.5 / 2 / 1e12)


def test_extract_user_code_only_with_reported_steps_and_without_a_model():
    spec = {**SPEC, "model": None, "entrypoint": {"script": "train.py"}}
    assert knowledge.extract(spec, {}, [], device_name="cpu") is None
    rec = knowledge.extract(spec, {}, samples({s: [0.5, 0.5] for s in range(1, 9)}), device_name="cpu")
    assert all(rec[k] is None for k in (*knowledge.SHAPE_FIELDS, "params", "global_batch", "tflops_per_device"))
    assert rec["step_time_s"] == 0.5 and rec["dp"] == 2 and rec["tokens_per_s"] == pytest.approx(400.0)


def test_a_user_model_that_run_prepare_described_gets_its_shape_in_the_record():
    spec = {**SPEC, "model": None, "entrypoint": {"script": "train.py"}, "parallel": {"fsdp": True}}
    described = {"kind": "user", "layers": 2, "hidden": 32, "heads": 2, "seq_len": 16, "vocab": 64,
                 "params": 30080, "params_per_block": 12704, "blocks": "h"}
    rec = knowledge.extract(spec, {}, samples({s: [0.5, 0.5] for s in range(1, 9)}), device_name="cpu",
                            described=described)
    assert {k: rec[k] for k in knowledge.SHAPE_FIELDS} == {"kind": "user", "layers": 2, "hidden": 32, "heads": 2,
                                                          "seq_len": 16, "vocab": 64}
    assert rec["params"] == 30080 and rec["global_batch"] == 32 and rec["fsdp"] is True and rec["dp"] == 2
    assert rec["tflops_per_device"] > 0
    # without the sequence length (no forward seen) it stays a record without a shape
    bare = knowledge.extract(spec, {}, samples({s: [0.5, 0.5] for s in range(1, 9)}), device_name="cpu",
                             described={k: v for k, v in described.items() if k != "seq_len"})
    assert bare["layers"] is None and bare["kind"] is None


def test_relative_error():
    assert knowledge.relative_error(0.11, 0.10) == pytest.approx(0.1)
    assert knowledge.relative_error(None, 0.1) is None and knowledge.relative_error(1.0, None) is None


def point(i, layers=4, hidden=128, seq_len=128, gb=32, world=2, created=0.0, **plan):
    return knowledge.Point(i, layers, hidden, seq_len, gb, world, 0.1, plan={"dp": world, "tp": 1, **plan},
                           created=created)


def test_nearest_ranks_by_log_ratio_distance_then_newest():
    q = {"layers": 4, "hidden": 128, "seq_len": 128, "global_batch": 32, "world": 2}
    pts = [point(1, hidden=512), point(2, hidden=64), point(3, layers=8, created=1.0), point(4, layers=8, created=2.0),
           point(5), point(6, world=4, gb=64)]
    ranked = knowledge.rank_nearest(q, pts, limit=5)
    assert [p.id for p, _ in ranked] == [5, 4, 3, 2, 6]  # 0; ln2 three times, newest first; ln2*sqrt2
    assert ranked[0][1] == 0 and ranked[1][1] == pytest.approx(math.log(2))
    assert ranked[4][1] == pytest.approx(math.log(2) * math.sqrt(2))
    # twice as large is as far as half as large; a dimension the query leaves out is not compared
    assert knowledge.distance({"hidden": 64}, {"hidden": 128}) == knowledge.distance({"hidden": 256}, {"hidden": 128})
    assert knowledge.distance({"layers": 4}, {"layers": 4, "hidden": 999}) == 0


def test_nearest_puts_records_of_the_asked_plan_first():
    q = {"layers": 4, "hidden": 128, "seq_len": 128, "global_batch": 32, "world": 2}
    pts = [point(1), point(2, hidden=1024, dp=1, tp=2), point(3, hidden=256, dp=1, tp=2)]
    assert [p.id for p, _ in knowledge.rank_nearest(q, pts, {"dp": 1, "tp": 2})] == [3, 2, 1]
    assert [p.id for p, _ in knowledge.rank_nearest(q, pts, None)] == [1, 3, 2]
    # the schedule matters only under pp
    assert knowledge.plan_matches({"dp": 2, "pp": 1, "schedule": "1f1b"}, {"pp": 1, "schedule": "gpipe"})
    assert not knowledge.plan_matches({"dp": 2, "pp": 2, "schedule": "1f1b"}, {"pp": 2, "schedule": "gpipe"})


def row(plan_dp, tps, *, hidden=128, device="cpu", step=0.1):
    return {"kind": "gpt", "layers": 4, "hidden": hidden, "heads": 4, "seq_len": 128, "vocab": 256,
            "global_batch": 32, "nodes": 2, "procs_per_node": 1, "device_name": device,
            "dp": plan_dp, "tp": 2 // plan_dp, "pp": 1, "micro_batch": 16, "fsdp": False, "shard_optimizer": False,
            "recompute": "none", "schedule": "1f1b", "tokens_per_s": tps, "step_time_s": step,
            "tflops_per_device": 0.01, "mem_bytes": 10}


def test_best_plan_per_shape_and_cluster_by_median_tokens_per_s():
    rows = [row(2, 1000), row(2, 1300), row(2, 1100), row(1, 1500), row(1, 900), row(1, 1000),
            row(2, 50, hidden=256), row(1, 70, device="NVIDIA H100 80GB HBM3"),
            {**row(2, 10), "kind": None}]  # user code: no shape to be best for
    best = knowledge.best_plans(rows)
    assert [(b["hidden"], b["device_name"]) for b in best] == [(128, "NVIDIA H100 80GB HBM3"), (128, "cpu"),
                                                               (256, "cpu")]
    cpu = best[1]
    # dp 2: median 1100 beats tp 2's median 1000 although tp 2 had the single fastest run
    assert cpu["plan"]["dp"] == 2 and cpu["tokens_per_s"] == 1100 and cpu["runs"] == 3
    assert cpu["plans_compared"] == 2 and cpu["runner_up_tokens_per_s"] == 1000
    assert best[2]["plans_compared"] == 1 and best[2]["runner_up_tokens_per_s"] is None


# ---------------------------------------------------------------- the predictor

JOB = JobShape(user="ann", team="nlp", nodes=2, procs_per_node=1, steps=200)


def measured(step_s, dist=0.0, **shape):
    from dataclasses import replace

    return MeasuredStep(replace(JOB, user="", team=None, **shape), step_s, dist)


def test_predictor_uses_the_nearest_records_when_no_run_had_the_same_key():
    p = predict(JOB, [], knowledge=[measured(0.30), measured(0.10), measured(0.20), measured(5.0, 0.7, hidden=256)])
    assert p.source == "knowledge: 3 runs of nearest shape" and p.samples == 3
    assert p.seconds == pytest.approx(STARTUP_S + 200 * 0.20)


def test_predictor_scales_a_neighbour_of_another_size_by_the_model():
    near = measured(0.40, math.log(2), hidden=256)
    p = predict(JOB, [], knowledge=[near])
    assert p.source == "knowledge: 1 run of nearest shape"
    assert p.seconds == pytest.approx(STARTUP_S + 200 * 0.40 * estimate_step_s(JOB) / estimate_step_s(near.shape))


def test_predictor_keeps_same_key_history_first_and_the_model_for_far_records():
    from dataclasses import replace

    history = [PastRun(replace(JOB, user="ann"), STARTUP_S + 0.5 * 100, 100)]
    assert predict(JOB, history, knowledge=[measured(0.1)]).source == "history:user"
    far = measured(0.1, 3.0, layers=64)
    p = predict(JOB, [], knowledge=[far])
    assert p.source == "model" and p.seconds == pytest.approx(STARTUP_S + 200 * estimate_step_s(JOB))
    assert predict(JOB, []).source == "model"
