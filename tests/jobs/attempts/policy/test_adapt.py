"""The adaptation policy (pure): the OOM re-plan's ladder, what it skips, the closest plan and its
shortfall, adapt_max, the first OOM per plan not counted; torch's CPU allocator failure is an OOM."""
from jobs.attempts.policy import adapt
from jobs.attempts.policy.adapt import PlanOption, oom_replan

CUR = {"dp": 2, "tp": 1, "pp": 1, "micro_batch": 8, "fsdp": False, "shard_optimizer": False, "recompute": "none"}


def opt(mem, step=0.01, **kw):
    return PlanOption(**{**CUR, **kw}, memory_gb=mem, step_time_s=step)


# the planner's view of a 2-device job: the current plan and one of each move (and a few that are not moves)
OPTIONS = [
    opt(1.0),                                                       # the current plan
    opt(0.9, 0.010, shard_optimizer=True),                          # ZeRO-1: cheapest of all
    opt(0.7, 0.013, recompute="full"),                              # recompute
    opt(0.6, 0.012, micro_batch=4),                                 # smaller micro-batch
    opt(0.5, 0.014, micro_batch=4, recompute="full"),               # both: rung micro-batch
    opt(0.8, 0.011, fsdp=True),                                     # fsdp
    opt(0.6, 0.016, dp=1, tp=2, micro_batch=16),                    # more tp (dp halves, micro-batch grows)
    opt(0.6, 0.016, dp=1, tp=2, micro_batch=8),                     # more tp, same micro-batch
    opt(0.4, 0.012, dp=1, pp=2),                                    # pipeline: not a memory move here
    opt(1.2, 0.009, micro_batch=16),                                # larger micro-batch: never
]


def test_ladder_order_recompute_then_micro_batch_then_zero1_fsdp_tp():
    seen, tried, oomed, current = [], [], [], CUR
    for _ in range(6):
        options = [o for o in OPTIONS]
        d = oom_replan(current, options, tried=tried, oomed_memory_gb=oomed, device_memory_gb=4.0)
        if d.choice is None:
            break
        seen.append(d.rung)
        tried.append(current)
        oomed.append(next(o.memory_gb for o in OPTIONS if o.key == adapt.plan_key(current)))
        current = d.choice.fields()
    # each OOM lowers the limit to the plan that ran out; the next move must predict below it
    assert seen == ["recompute", "micro-batch"]
    assert current["micro_batch"] == 4 and current["recompute"] == "full"


def test_first_choice_is_recompute_even_when_zero1_is_predicted_faster():
    d = oom_replan(CUR, OPTIONS, tried=[], oomed_memory_gb=[1.0], device_memory_gb=4.0)
    assert d.rung == "recompute" and d.choice.recompute == "full" and d.choice.micro_batch == 8
    assert "predicted 0.7 GB" in d.message


def test_ladder_reaches_zero1_fsdp_and_tp_when_the_earlier_rungs_are_gone():
    cur = {**CUR, "recompute": "full", "micro_batch": 1}
    options = [opt(1.0, recompute="full", micro_batch=1), opt(0.9, 0.02, recompute="full", micro_batch=1,
                                                                shard_optimizer=True),
               opt(0.8, 0.02, recompute="full", micro_batch=1, fsdp=True),
               opt(0.7, 0.03, recompute="full", micro_batch=1, dp=1, tp=2)]

    def walk(cur, options):
        rungs, tried, oomed = [], [], [1.0]
        while (d := oom_replan(cur, options, tried=tried, oomed_memory_gb=oomed, device_memory_gb=4.0)).choice:
            rungs.append(d.rung)
            tried.append(cur)
            oomed.append(d.choice.memory_gb)
            cur = d.choice.fields()
        return rungs

    # fsdp is never turned back off, and the spec runs no fsdp with tp: tp comes from ZeRO-1's plan or none
    assert walk(cur, options) == ["zero1", "fsdp"]
    assert walk(cur, [o for o in options if not o.fsdp]) == ["zero1", "tp"]


def test_tried_plans_and_plans_not_below_an_oomed_plan_are_skipped():
    recompute = opt(0.7, 0.013, recompute="full").fields()
    d = oom_replan(CUR, OPTIONS, tried=[recompute], oomed_memory_gb=[1.0], device_memory_gb=4.0)
    assert d.rung == "micro-batch" and d.choice.micro_batch == 4 and d.choice.recompute == "none"
    # a plan that ran out at 0.55 GB predicted: only what predicts less than that is a candidate
    d = oom_replan(CUR, OPTIONS, tried=[], oomed_memory_gb=[1.0, 0.55], device_memory_gb=4.0)
    assert d.choice.memory_gb == 0.5 and d.limit_gb == 0.55


def test_no_plan_fits_names_the_closest_and_its_shortfall():
    d = oom_replan(CUR, OPTIONS, tried=[], oomed_memory_gb=[1.0, 0.3], device_memory_gb=4.0)
    assert d.choice is None and d.closest.memory_gb == 0.5 and d.shortfall_gb == 0.2
    assert "needs 0.5 GB a device, 0.2 GB more than the 0.3 GB" in d.message
    assert "micro-batch 4, recompute full" in d.message


def test_device_memory_bounds_the_limit_too():
    d = oom_replan(CUR, OPTIONS, tried=[], oomed_memory_gb=[], device_memory_gb=0.65)
    assert d.limit_gb == 0.65 and d.choice.micro_batch == 4 and d.rung == "micro-batch"


def test_may_adapt_honours_advise_and_adapt_max():
    assert adapt.may_adapt("advise", 3, []) == (False, "adapt is advise")
    assert adapt.may_adapt("auto", 3, [{"kind": "oom"}] * 2)[0]
    ok, why = adapt.may_adapt("auto", 3, [{"kind": "oom"}] * 3)
    assert not ok and "adapt_max" in why
    assert not adapt.may_adapt("auto", 0, [])[0]


def test_first_oom_per_plan_is_not_counted_against_max_restarts():
    assert not adapt.oom_counts_as_restart(CUR, [])
    other = {**CUR, "recompute": "full"}
    assert not adapt.oom_counts_as_restart(CUR, [{"kind": "oom", "before": None, "plan_before": other}])
    history = [{"kind": "oom", "plan_before": CUR, "plan_after": other}]
    assert adapt.oom_counts_as_restart(CUR, history)  # this very plan ran out before (a revert brought it back)


def test_torch_cpu_allocator_failure_is_an_oom():
    from jobs.attempts.policy.diagnosis import diagnose

    text = ("RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
            "you tried to allocate 67108864 bytes. Error code 12 (Cannot allocate memory)")
    d = diagnose([{"node": "node-a", "failures": [{"rank": 1, "timestamp": 1.0, "message": text, "traceback": text}]}])
    assert d.failure_class == "oom" and not d.retry and d.rank == 1 and "recompute" in d.suggestion
