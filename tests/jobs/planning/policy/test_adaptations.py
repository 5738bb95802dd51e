"""Adaptation outcomes, pure (jobs/planning/policy/adaptations.py): what an entry records, which
planner plans are kept off, which kept change a new job starts with."""
from jobs.planning.policy import adaptations
from jobs.planning.policy.adaptations import OomedPlan, keep_off_oomed, outcome_fields, starting_changes

SPEC = {"model": {"kind": "gpt", "layers": 4, "hidden": 128, "heads": 4, "seq_len": 128, "vocab": 256},
        "train": {"global_batch": 32}, "resources": {"nodes": 2, "procs_per_node": 1, "device": "cpu"},
        "comm": {"compression": "none", "sync": "allreduce"}, "data": {"workers": 0}, "entrypoint": None}
WHERE = {"nodes": 2, "procs_per_node": 1, "device_name": "cpu"}
PLAN = {"dp": 2, "tp": 1, "pp": 1, "micro_batch": 16, "fsdp": False, "shard_optimizer": False, "recompute": "none",
        "schedule": None}


def test_an_oom_entry_records_the_plan_that_ran_out_and_its_configuration():
    f = outcome_fields(SPEC, {"kind": "oom", "attempt_number": 2, "plan_before": PLAN, "plan_after": {},
                              "predicted": {"limit_gb": 0.5}}, **WHERE, device_memory_gb=12.0)
    assert f == {"attempt_number": 2, "model_kind": "gpt", "layers": 4, "hidden": 128, "heads": 4, "seq_len": 128,
                 "vocab": 256, "global_batch": 32, **WHERE, "kind": "oom", **PLAN, "limit_gb": 0.5,
                 "device_memory_gb": 12.0}
    # user code has no shape: recorded with nulls (and never matched)
    user = outcome_fields({**SPEC, "entrypoint": {"script": "t.py"}}, {"kind": "oom", "plan_before": PLAN}, **WHERE)
    assert user["model_kind"] is None and user["layers"] is None


def test_a_bottleneck_entry_records_only_once_kept_or_reverted():
    entry = {"kind": "bottleneck", "class": "communication", "attempt_number": 1, "change": {"comm.compression": "fp16"},
             "before": {"comm.compression": "none"}, "predicted": {"gain": 0.4}, "step_s_before": 0.2,
             "step_s_after": 0.15, "measured_gain": 0.33}
    assert outcome_fields(SPEC, entry, **WHERE) is None
    f = outcome_fields(SPEC, {**entry, "outcome": "kept"}, **WHERE)
    assert (f["kind"], f["outcome"], f["bottleneck_class"], f["change"], f["before"], f["predicted_gain"],
            f["measured_gain"], f["step_s_after"]) == ("bottleneck", "kept", "communication",
                                                       {"comm.compression": "fp16"}, {"comm.compression": "none"},
                                                       0.4, 0.33, 0.15)


def test_plans_that_ran_out_are_moved_out_unless_this_device_has_more_memory():
    other = {**PLAN, "micro_batch": 8}
    plans = [{**PLAN, "step_time_s": 0.1, "memory_gb_per_device": 1.0},
             {**other, "step_time_s": 0.12, "memory_gb_per_device": 0.6}]
    oomed = [OomedPlan(7, 1, {**PLAN, "schedule": "1f1b"}, 0.9, 4.0)]  # the schedule does not count under pp 1
    kept, moved = keep_off_oomed(plans, oomed, memory_gb=4.0)
    assert kept == [plans[1]] and [m["micro_batch"] for m in moved] == [16]
    assert "ran out of memory in job 7 (attempt 1) on a 4 GB device" in moved[0]["reason"]
    assert moved[0]["ran_out"] == {"job": 7, "attempt": 1, "limit_gb": 0.9, "device_memory_gb": 4.0}
    assert keep_off_oomed(plans, oomed, memory_gb=8.0) == (plans, [])  # a larger device may hold it
    assert keep_off_oomed(plans, oomed, memory_gb=2.0)[0] == [plans[1]]  # a smaller one will not
    assert keep_off_oomed(plans, [OomedPlan(None, None, PLAN, None, None)], 8.0)[0] == [plans[1]]  # unknown: off


def test_the_newest_outcome_of_a_change_decides_and_the_spec_must_have_what_it_replaced():
    fp16 = {"change": {"comm.compression": "fp16"}, "before": {"comm.compression": "none"}}
    workers = {"change": {"data.workers": 4}, "before": {"data.workers": 0}}
    kept = [{**fp16, "outcome": "kept", "id": 3}, {**workers, "outcome": "kept", "id": 2}]
    assert [o["id"] for o in starting_changes(SPEC, kept)] == [3, 2]  # newest first
    reverted_later = [{**fp16, "outcome": "reverted", "id": 4}, *kept]
    assert [o["id"] for o in starting_changes(SPEC, reverted_later)] == [2]
    only_reverted = [{**fp16, "outcome": "reverted", "id": 1}]
    assert starting_changes(SPEC, only_reverted) == []
    moved_on = {**SPEC, "comm": {"compression": "topk"}}  # no longer what the change replaced
    assert [o["id"] for o in starting_changes(moved_on, kept)] == [2]
    running_it = {**SPEC, "comm": {"compression": "fp16"}}  # already runs it: nothing to start with
    assert [o["id"] for o in starting_changes(running_it, kept)] == [2]
    unknown_before = [{"change": {"comm.compression": "fp16"}, "before": {}, "outcome": "kept"}]
    assert starting_changes(SPEC, unknown_before) == []
    assert adaptations.change_key({"b": 1, "a": 2}) == adaptations.change_key({"a": 2, "b": 1})
