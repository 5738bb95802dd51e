"""The pure policy for entrypoint jobs (user code): its plan, its run-time prediction and when the
hang detector may judge it."""
from dataclasses import replace

import pytest

from jobs.planning.policy import planner
from jobs.attempts.policy.diagnosis import STARTUP_GRACE_S, hang_armed, hang_check
from jobs.planning.policy.predictor import STARTUP_S, JobShape, PastRun, predict, shape_from_spec
from trainyard.spec import parse_job_spec

BUNDLE = "sha256:" + "cd" * 32
OTHER = "sha256:" + "ef" * 32


def user_spec(**kw) -> dict:
    return parse_job_spec({"name": "mine", "code": {"bundle": BUNDLE},
                           "entrypoint": {"script": "train.py", "args": ["--lr", "1"]}, **kw}).to_json()


# ---------------------------------------------------------------- plan

def test_a_user_code_plan_is_plain_dp_with_a_replica_per_process():
    plan = planner.describe(user_spec(resources={"nodes": 2, "procs_per_node": 2}))
    assert (plan["dp"], plan["tp"], plan["pp"], plan["fsdp"], plan["world_size"]) == (4, 1, 1, False, 4)
    assert plan["strategy"] == "dp 4" and plan["user_code"] is True
    assert [r["role"] for r in plan["roles"]] == [f"data-parallel replica {r}/4" for r in range(4)]
    assert [r["coords"]["dp"] for r in plan["roles"]] == [0, 1, 2, 3]
    assert [d["name"] for d in plan["dims"]] == ["dp"] and "script" in plan["dims"][0]["meaning"]
    assert "microbatches" not in plan  # no stage split: the model is the script's


def test_a_single_process_user_code_plan_has_no_dims():
    plan = planner.describe(user_spec(resources={"nodes": 1, "procs_per_node": 1}))
    assert plan["dims"] == [] and plan["roles"] == [{"rank": 0, "coords": {"pp": 0, "dp": 0, "tp": 0},
                                                     "role": "data-parallel replica 0/1"}]


# ---------------------------------------------------------------- prediction

def test_the_shape_of_a_user_code_job_is_its_code_and_resources():
    s = shape_from_spec(user_spec(resources={"nodes": 2, "procs_per_node": 1}, train={"steps": 500}), "ann", "nlp")
    assert (s.entrypoint, s.bundle, s.steps, s.nodes) == ("train.py", BUNDLE, 500, 2)
    assert s.key == ("entrypoint", "train.py", BUNDLE, 2, 1, "cpu")
    module = shape_from_spec(parse_job_spec({"name": "m", "entrypoint": {"module": "pkg.train"}}).to_json())
    assert (module.entrypoint, module.bundle) == ("-m pkg.train", None)
    assert shape_from_spec(parse_job_spec({"name": "b"}).to_json()).entrypoint is None  # built-in


MINE = JobShape(user="ann", team="nlp", nodes=2, procs_per_node=1, steps=100, entrypoint="train.py", bundle=BUNDLE)


def run(shape=MINE, duration=None, per_step=0.5, steps=100, at=0.0, **kw):
    s = replace(shape, **kw)
    return PastRun(s, duration if duration is not None else STARTUP_S + per_step * steps, steps, at)


CASES = [
    ("never ran: no prediction", [], "none", None),
    ("the user's runs of the same bundle, per step x steps", [run(per_step=0.2, steps=50)], "history:user",
     STARTUP_S + 0.2 * 100),
    ("a script without the SDK reports no steps: its whole duration", [run(duration=321.0, steps=0)],
     "history:user", 321.0),
    ("the team's runs of the same bundle", [run(per_step=0.3, user="bob")], "history:team", STARTUP_S + 30),
    ("anyone's run of the same bundle (same digest, same code)", [run(per_step=0.4, user="cy", team="cv")],
     "history:any", STARTUP_S + 40),
    ("then the user's runs of the same script from an earlier bundle", [run(per_step=0.6, bundle=OTHER)],
     "history:entrypoint", STARTUP_S + 60),
    ("someone else's train.py from another bundle is not this code", [run(per_step=0.6, bundle=OTHER, user="bob")],
     "none", None),
    ("another script is not similar", [run(per_step=0.5, entrypoint="eval.py")], "none", None),
    ("other resources are not similar", [run(per_step=0.5, nodes=4)], "none", None),
    ("a built-in run never predicts user code", [PastRun(JobShape(user="ann", nodes=2), 99.0, 100, 0.0)],
     "none", None),
    ("the median of the last five", [run(duration=d, steps=0, at=i) for i, d in enumerate([900, 900, 10, 20, 30, 40, 50])],
     "history:user", 30.0),
]


@pytest.mark.parametrize("desc,history,source,seconds", CASES, ids=[c[0] for c in CASES])
def test_user_code_prediction(desc, history, source, seconds):
    p = predict(MINE, history)
    assert p.source == source
    assert p.seconds == (pytest.approx(seconds) if seconds is not None else None)
    assert p.samples == min(5, len(history)) if seconds is not None else p.samples == 0


def test_user_code_history_never_predicts_a_built_in_job():
    builtin = JobShape(user="ann", team="nlp", nodes=2, procs_per_node=1, steps=100)
    assert predict(builtin, [run(per_step=0.2)]).source == "model"


# ---------------------------------------------------------------- hangs

def test_user_code_with_auto_timeout_is_judged_only_from_its_first_step():
    # a script without the SDK never reports a step: never hung, however long it runs
    c = hang_check(now=10 * STARTUP_GRACE_S, started=0, last_progress=None, spec_timeout="auto",
                   recent_step_s=[], floor_s=60, user_code=True)
    assert not c.hung and c.timeout_s == float("inf")
    assert not hang_armed("auto", user_code=True, last_progress=None)
    # once it reported a step (the SDK), auto works as for the built-in trainer
    assert hang_armed("auto", user_code=True, last_progress=5.0)
    assert hang_check(now=1000, started=0, last_progress=100, spec_timeout="auto", recent_step_s=[1.0],
                      floor_s=60, user_code=True).hung
    assert not hang_check(now=150, started=0, last_progress=100, spec_timeout="auto", recent_step_s=[1.0],
                          floor_s=60, user_code=True).hung


def test_an_explicit_timeout_applies_to_user_code_from_the_start():
    assert hang_armed(300, user_code=True, last_progress=None)
    assert hang_check(now=400, started=0, last_progress=None, spec_timeout=300, recent_step_s=[], floor_s=60,
                      user_code=True).hung


def test_built_in_jobs_keep_the_startup_grace():
    assert hang_armed("auto", user_code=False, last_progress=None)
    assert hang_check(now=STARTUP_GRACE_S + 1, started=0, last_progress=None, spec_timeout="auto",
                      recent_step_s=[], floor_s=60).hung
