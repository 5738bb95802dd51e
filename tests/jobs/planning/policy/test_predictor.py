"""Table-driven tests of run-time prediction."""
import pytest

from jobs.planning.policy.predictor import STARTUP_S, JobShape, PastRun, TraceHistory, estimate_step_s, parameters, predict, shape_from_spec

DEMO = JobShape(user="ann", team="nlp", nodes=2, procs_per_node=1, steps=200)


def past(shape=DEMO, per_step=0.5, steps=100, at=0.0, **kw):
    from dataclasses import replace
    s = replace(shape, **kw)
    return PastRun(s, STARTUP_S + per_step * steps, steps, at)


CASES = [
    ("the user's own runs first", [past(per_step=0.5, user="bob"), past(per_step=0.2)], "history:user", 0.2),
    ("then the team's", [past(per_step=0.3, user="bob"), past(per_step=0.9, user="cy", team="cv")],
     "history:team", 0.3),
    ("then anyone's", [past(per_step=0.7, user="cy", team="cv")], "history:any", 0.7),
    ("median of the last five", [past(per_step=x, at=i) for i, x in enumerate([9, 9, 0.1, 0.2, 0.3, 9, 0.4])],
     "history:user", 0.3),
    ("scaled by steps: a run stopped early still gives its step time", [past(per_step=0.25, steps=10)],
     "history:user", 0.25),
    ("a different model shape is not similar", [past(per_step=0.5, hidden=256)], "model", None),
    ("different resources are not similar", [past(per_step=0.5, nodes=4)], "model", None),
]


@pytest.mark.parametrize("desc,history,source,per_step", CASES, ids=[c[0] for c in CASES])
def test_predict(desc, history, source, per_step):
    p = predict(DEMO, history)
    assert p.source == source
    if per_step is not None:
        assert p.seconds == pytest.approx(STARTUP_S + per_step * DEMO.steps)
    else:
        assert p.seconds == pytest.approx(STARTUP_S + DEMO.steps * estimate_step_s(DEMO))


def test_step_time_model_matches_measured_demo():
    # the demo GPT (875,264 parameters) at 16 x 128 tokens per rank measured 0.24 s a step on one
    # CPU thread; 2 ranks add a gloo all-reduce of 3.5 MB
    assert parameters(JobShape()) == 875_264
    assert parameters(JobShape(kind="mlp")) == 131_840
    assert 0.2 < estimate_step_s(DEMO) < 0.35
    # more ranks: less compute each, more all-reduce; a bigger model: slower
    assert estimate_step_s(JobShape(hidden=256, layers=8, heads=8)) > 4 * estimate_step_s(JobShape())
    assert estimate_step_s(JobShape(device="cuda")) < estimate_step_s(JobShape())


def test_shape_from_spec():
    spec = {"model": {"kind": "gpt", "layers": 2, "hidden": 64, "heads": 2, "seq_len": 32, "vocab": 256},
            "train": {"steps": 50, "global_batch": 8, "grad_accum": 2},
            "resources": {"nodes": 2, "procs_per_node": 2, "device": "cpu"}}
    s = shape_from_spec(spec, "ann", "nlp")
    assert (s.user, s.team, s.layers, s.hidden, s.steps, s.global_batch, s.grad_accum, s.world_size) == (
        "ann", "nlp", 2, 64, 50, 8, 2, 4)
    assert shape_from_spec({}, "ann").key == JobShape().key


TRACE_CASES = [
    ("no history: the declared estimate", [], ("ann", 1, 3600), 3600),
    ("similar jobs: the user's padding learnt", [("ann", 1, 3600, 900), ("ann", 1, 4000, 1000)], ("ann", 1, 3600), 900),
    ("different slots: the user's habit in general",
     [("ann", 8, 3600, 1800), ("ann", 8, 7200, 3600)], ("ann", 1, 1000), 500),
    ("someone else's history does not count", [("bob", 1, 3600, 360)], ("ann", 1, 3600), 3600),
    ("ratios are clamped", [("ann", 1, 100, 1e6)], ("ann", 1, 100), 200),
]


@pytest.mark.parametrize("desc,history,job,expected", TRACE_CASES, ids=[c[0] for c in TRACE_CASES])
def test_trace_history(desc, history, job, expected):
    h = TraceHistory()
    for user, slots, est, dur in history:
        h.add(user, slots, est, dur)
    assert h.predict(*job) == pytest.approx(expected)
