"""ASHA as a stopping rule (jobs/experiments/policy/asha.py): rungs, and who is stopped where."""
import math

import pytest

from jobs.experiments.policy.asha import AshaConfig, TrialRungs, best, decide, rung_reached, rungs


@pytest.mark.parametrize("min_steps,reduction,max_steps,expected", [
    (10, 2, 100, (10, 20, 40, 80)),
    (10, 3, 100, (10, 30, 90)),
    (10, 3, 90, (10, 30)),          # no rung at the last step: finishing is the last word
    (50, 2, 50, ()),
    (1, 2, 9, (1, 2, 4, 8)),
])
def test_rungs_are_min_steps_times_reduction_powers_below_the_end(min_steps, reduction, max_steps, expected):
    assert rungs(AshaConfig(min_steps, reduction, max_steps)) == expected


@pytest.mark.parametrize("step,expected", [(0, None), (9, None), (10, 0), (29, 0), (30, 1), (95, 2), (500, 2)])
def test_rung_reached(step, expected):
    assert rung_reached(AshaConfig(10, 3, 100), step) == expected


def T(n, values, running=True, judged=None, step=0):
    return TrialRungs(trial=n, values=tuple(values), step=step, running=running, judged=judged)


CFG = AshaConfig(10, 2, 100, "min")
CFG3 = AshaConfig(10, 3, 100, "min")


@pytest.mark.parametrize("cfg,trials,expected", [
    # the first trial at a rung always goes on
    (CFG, [T(0, [(0, 5.0)])], [(0, 0, False)]),
    # 2 at the rung, keep ceil(2/2) = 1: the worse stops, whichever arrived last
    (CFG, [T(0, [(0, 1.0)], judged=0), T(1, [(0, 5.0)])], [(1, 0, True)]),
    (CFG, [T(0, [(0, 5.0)], judged=0), T(1, [(0, 1.0)])], [(1, 0, False)]),
    # an ended trial still counts as a peer, but is not judged itself
    (CFG, [T(0, [(0, 1.0)], running=False), T(1, [(0, 2.0)])], [(1, 0, True)]),
    # reduction 3: 3 peers keep 1; 4 peers keep 2
    (CFG3, [T(0, [(0, 1.0)], judged=0), T(1, [(0, 2.0)], judged=0), T(2, [(0, 1.5)])], [(2, 0, True)]),
    (CFG3, [T(0, [(0, 1.0)], judged=0), T(1, [(0, 2.0)], judged=0), T(2, [(0, 3.0)], judged=0),
            T(3, [(0, 1.5)])], [(3, 0, False)]),
    # judged rungs are not judged again; a trial stopped at rung 0 is not judged at rung 1
    # two reaching a rung in the same pass are judged against each other
    (CFG, [T(0, [(0, 1.0), (1, 0.5)], judged=0), T(1, [(0, 0.9), (1, 0.4)], judged=0)], [(0, 1, True), (1, 1, False)]),
    (CFG, [T(0, [(0, 1.0)], judged=0), T(1, [(0, 5.0), (1, 0.1)])], [(1, 0, True)]),
    # a NaN metric (diverged) is stopped
    (CFG, [T(0, [(0, 1.0)], judged=0), T(1, [(0, math.nan)])], [(1, 0, True)]),
    # ... also when it is the first (and only) trial at its rung
    (CFG, [T(0, [(0, math.nan)])], [(0, 0, True)]),
    # ties go to the earlier trial
    (CFG, [T(0, [(0, 1.0)], judged=0), T(1, [(0, 1.0)])], [(1, 0, True)]),
])
def test_decisions_min(cfg, trials, expected):
    got = [(d.trial, d.rung, d.stop) for d in decide(cfg, tuple(trials))]
    assert got == expected


def test_mode_max_keeps_the_higher():
    cfg = AshaConfig(10, 2, 100, "max")
    d = decide(cfg, (T(0, [(0, 0.9)], judged=0), T(1, [(0, 0.5)])))
    assert [(x.trial, x.stop, x.cutoff, x.peers, x.keep) for x in d] == [(1, True, 0.9, 2, 1)]


def test_a_rung_at_or_past_the_end_is_not_judged():
    cfg = AshaConfig(10, 2, 20, "min")  # rungs: (10,)
    assert decide(cfg, (T(0, [(0, 1.0)], judged=0), T(1, [(0, 2.0), (1, 9.0)], judged=0))) == ()


@pytest.mark.parametrize("mode,values,expected", [
    ("min", [(0, 2.0), (1, 1.0), (2, 3.0)], (1, 1.0)),
    ("max", [(0, 2.0), (1, 1.0), (2, 3.0)], (2, 3.0)),
    ("min", [(0, 1.0), (1, 1.0)], (0, 1.0)),
    ("min", [(0, math.nan), (1, None)], None),
    ("min", [], None),
])
def test_best(mode, values, expected):
    assert best(mode, tuple(values)) == expected
