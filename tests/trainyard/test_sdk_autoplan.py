"""trainyard/sdk/autoplan.py: parallel auto for a user's own model, planned from run.prepare's
description with the control plane's planner (no processes, no torch)."""
import pytest

from trainyard.plan.constants import DEFAULT_CPU
from trainyard.sdk.autoplan import by_preference, plan_user_model
from trainyard.sdk.config import ConfigError
from trainyard.spec import parse_job_spec

LLAMA = {"kind": "user", "layers": 2, "hidden": 32, "heads": 4, "vocab": 64, "params": 34976, "seq_len": 16}


def spec(procs: int = 2, **extra):
    return parse_job_spec({"name": "u", "entrypoint": {"script": "/opt/train.py"}, "parallel": "auto",
                           "train": {"global_batch": 8}, "resources": {"nodes": 1, "procs_per_node": procs}, **extra})


def test_the_best_runnable_plan_becomes_the_spec_and_the_choice_says_why_the_others_lost():
    resolved, auto = plan_user_model(spec(), LLAMA, None, lambda tp: True)
    c = auto["chosen"]
    assert resolved.parallel != "auto" and resolved.plan.tp == c["tp"] and resolved.dp == c["dp"]
    assert resolved.train.grad_accum == 8 // c["dp"] // c["micro_batch"] and c["pp"] == 1
    assert auto["candidates"] >= 3 and auto["constants_source"] == DEFAULT_CPU.source
    assert all("slower by" in r["why"] or "a tie, and it has more moving parts" in r["why"] for r in auto["runners_up"])
    assert plan_user_model(spec(), LLAMA, None, lambda tp: True)[1] == auto  # every rank plans the same


def test_only_plans_prepare_can_apply_are_searched():
    _, auto = plan_user_model(spec(), LLAMA, None, lambda tp: False)  # a model tp cannot split
    assert auto["chosen"]["tp"] == 1 and all("tp 2" not in r["label"] for r in auto["runners_up"])
    _, four = plan_user_model(spec(4), LLAMA, None, lambda tp: True)
    assert not any("pp 2" in r["label"] or "pp 4" in r["label"] for r in four["runners_up"])  # no pp for user code


def test_the_launch_configs_constants_and_device_are_used():
    inputs = {"device": {"name": "cpu", "memory_gb": 8.0, "peak_tflops": 0.5},
              "constants": {**DEFAULT_CPU.to_dict(), "source": "calibration 3 of node-a"}}
    _, auto = plan_user_model(spec(), LLAMA, inputs, lambda tp: True)
    assert auto["constants_source"] == "calibration 3 of node-a"
    with pytest.raises(ConfigError, match="planner.constants"):
        plan_user_model(spec(), LLAMA, {"constants": {"matmul_eff": "x"}}, lambda tp: True)


def test_a_model_that_fits_nowhere_fails_naming_the_closest_plan():
    huge = {**LLAMA, "layers": 200, "hidden": 16384, "heads": 128, "params": 10**12}
    with pytest.raises(ConfigError, match=r"parallel auto: fits nowhere on this cluster: the closest plan \(dp"):
        plan_user_model(spec(), huge, None, lambda tp: True)


def _row(t, **kw):
    return {"dp": 2, "tp": 1, "pp": 1, "micro_batch": 8, "fsdp": False, "shard_optimizer": False, "recompute": "none",
            "step_time_s": t, **kw}


def test_predictions_within_the_models_error_are_a_tie_broken_toward_fewer_moving_parts():
    zero, plain, fsdp = _row(1.000, shard_optimizer=True), _row(1.004), _row(0.999, fsdp=True)
    assert by_preference([fsdp, zero, plain])[0] is plain  # all within 3%: plain DDP
    far = _row(1.2)
    assert by_preference([zero, far])[0] is zero  # 20% slower is no tie
    small = _row(1.01, micro_batch=4)
    assert by_preference([small, plain])[0] is plain  # whole micro-batches before grad_accum
