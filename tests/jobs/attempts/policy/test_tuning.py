"""adapt auto's sustained-bottleneck decisions (pure): arm after SUSTAIN_STEPS of the same class and
recommendation, apply at a checkpoint at or after the arming step, keep a change that measured
faster, revert one that did not, drop one whose profile changed while waiting, respect adapt_max."""
from jobs.attempts.policy import tuning

CHANGE = {"comm.compression": "bf16"}


def prof(cls="communication", since=0, change=CHANGE, gain=0.4, kind="compression"):
    return {"class": cls, "class_since_step": since, "shares": {"compute": 0.5, "communication": 0.45, "input": 0.05},
            "window": {"step_s": 0.2},
            "recommendation": {"kind": kind, "change": change, "before": {"comm.compression": "none"},
                               "predicted_gain": gain, "predicted_step_s": 0.15, "text": "compress"}}


def state(**kw):
    base = dict(adapt="auto", adapt_max=3, adaptations=[], profile=prof(), attempt_number=1, last_step=30,
                checkpoint_step=20, results=())
    return tuning.TuningState(**{**base, **kw})


def entry(outcome, **kw):
    return {"kind": "bottleneck", "class": "communication", "attempt_number": 1, "armed_step": 30, "change": CHANGE,
            "before": {"comm.compression": "none"}, "outcome": outcome, "applied": outcome != "waiting",
            "applied_event": 7, **kw}


def test_arms_only_after_the_class_held_for_the_window():
    assert tuning.decide(state(last_step=tuning.SUSTAIN_STEPS - 1)).action == "none"
    d = tuning.decide(state(last_step=tuning.SUSTAIN_STEPS))
    assert d.action == "arm" and d.change == CHANGE and d.reason == f"communication-bound for {tuning.SUSTAIN_STEPS} steps"


def test_nothing_for_advise_compute_bound_small_gains_or_no_change():
    assert tuning.decide(state(adapt="advise")).action == "none"
    assert tuning.decide(state(profile=prof(cls="compute"))).action == "none"
    assert tuning.decide(state(profile=prof(gain=0.01))).action == "none"
    assert tuning.decide(state(profile=prof(change=None))).action == "none"
    assert tuning.decide(state(profile=prof(kind="revert"))).action == "none"


def test_adapt_max_counts_applied_adaptations_only():
    done = [{"kind": "oom", "applied": True}] * 2 + [entry("dropped", applied=False)]
    assert tuning.decide(state(adaptations=done)).action == "arm"
    assert tuning.decide(state(adaptations=done + [entry("kept")], adapt_max=3)).action == "none"


def test_waiting_applies_at_a_checkpoint_at_or_after_the_arming_step():
    waiting = [entry("waiting")]
    assert tuning.decide(state(adaptations=waiting, checkpoint_step=20)).action == "none"
    d = tuning.decide(state(adaptations=waiting, checkpoint_step=30))
    assert d.action == "apply" and d.change == CHANGE


def test_waiting_is_dropped_when_the_profile_or_attempt_changes():
    waiting = [entry("waiting")]
    assert tuning.decide(state(adaptations=waiting, profile=prof(cls="compute"))).action == "drop"
    assert tuning.decide(state(adaptations=waiting, profile=prof(change={"comm.sync": "local_sgd"}))).action == "drop"
    assert tuning.decide(state(adaptations=waiting, attempt_number=2)).action == "drop"


def test_measured_faster_is_kept_slower_is_reverted_at_the_next_checkpoint():
    measuring = [entry("measuring")]
    assert tuning.decide(state(adaptations=measuring)).action == "none"  # no result yet
    faster = tuning.decide(state(adaptations=measuring, results=[{"applied": 7, "measured_gain": 0.3}]))
    assert faster.action == "keep"
    slower = tuning.decide(state(adaptations=measuring, results=[{"applied": 7, "measured_gain": -0.2}]))
    assert slower.action == "revert_arm" and slower.change == {"comm.compression": "none"}
    other = tuning.decide(state(adaptations=measuring, results=[{"applied": 6, "measured_gain": 0.3}]))
    assert other.action == "none"  # an older application's result is not this one's
    reverting = [entry("reverting", armed_step=40)]
    assert tuning.decide(state(adaptations=reverting, checkpoint_step=35)).action == "none"
    assert tuning.decide(state(adaptations=reverting, checkpoint_step=40)).action == "revert"
