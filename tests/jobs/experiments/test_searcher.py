"""Optuna's samplers over a study rebuilt from the trial rows (jobs/experiments/searcher.py)."""
import math

from jobs.experiments.searcher import PastTrial, suggest
from trainyard.search import parse_search

SPACE = {"train.lr": {"loguniform": [1e-5, 1e-2]}, "model.layers": {"choice": [1, 2, {"odd": True}]},
         "train.warmup_steps": {"int": [0, 9]}, "train.seed": {"uniform": [0.5, 0.75]}}


def run(search, n, score=lambda values: values["train.lr"]):
    """n suggestions, each trial completing with `score(values)`, the history rebuilt every time."""
    history, out = [], []
    for _ in range(n):
        s = suggest(search, history)
        if s is None:
            break
        out.append(s.values)
        history.append(PastTrial(s.number, s.params, "complete", value=score(s.values)))
    return out


def test_random_respects_bounds_and_types():
    search = parse_search({"space": SPACE, "max_trials": 50, "seed": 7})
    got = run(search, 50)
    assert len(got) == 50
    for v in got:
        assert 1e-5 <= v["train.lr"] <= 1e-2
        assert v["model.layers"] in (1, 2, {"odd": True})
        assert isinstance(v["train.warmup_steps"], int) and 0 <= v["train.warmup_steps"] <= 9
        assert 0.5 <= v["train.seed"] <= 0.75
    # log-uniform: about as many draws below the geometric middle (3.2e-4) as above it
    low = sum(v["train.lr"] < math.sqrt(1e-5 * 1e-2) for v in got)
    assert 12 <= low <= 38
    assert len({v["train.lr"] for v in got}) == 50  # a rebuilt study never replays an earlier draw
    assert {str(v["model.layers"]) for v in got} == {"1", "2", "{'odd': True}"}


def test_tpe_is_reproducible_with_a_seed_and_differs_with_another():
    search = parse_search({"space": SPACE, "algorithm": "tpe", "max_trials": 16, "seed": 3})
    first, again = run(search, 16), run(search, 16)
    assert first == again
    other = run(parse_search({**search.to_json(), "seed": 4}), 16)
    assert other != first


def test_tpe_moves_towards_the_better_region():
    # the metric is best at small lr: after the random start TPE draws small lrs more often
    search = parse_search({"space": {"train.lr": {"loguniform": [1e-5, 1e-1]}}, "algorithm": "tpe",
                           "max_trials": 40, "seed": 1})
    got = run(search, 40, score=lambda v: math.log10(v["train.lr"]))
    start, later = got[:10], got[20:]
    share = lambda vs: sum(v["train.lr"] < 1e-3 for v in vs) / len(vs)  # noqa: E731
    assert share(later) > share(start)


def test_grid_enumerates_every_point_once_then_stops():
    search = parse_search({"algorithm": "grid", "max_trials": 100,
                           "space": {"model.layers": {"choice": [1, 2]}, "train.warmup_steps": {"int": [0, 2]}}})
    got = run(search, 100, score=lambda v: v["train.warmup_steps"])
    assert len(got) == 6
    assert sorted((v["model.layers"], v["train.warmup_steps"]) for v in got) == [
        (a, b) for a in (1, 2) for b in (0, 1, 2)]


def test_grid_with_running_and_pruned_trials_still_never_repeats():
    search = parse_search({"algorithm": "grid", "space": {"model.layers": {"choice": [1, 2, 3, 4]}}})
    history, seen = [], []
    for i in range(4):
        s = suggest(search, history)
        seen.append(s.values["model.layers"])
        history.append(PastTrial(s.number, s.params, ("running", "pruned", "fail", "complete")[i], value=1.0,
                                 intermediate={10: 2.0}))
    assert sorted(seen) == [1, 2, 3, 4]
    assert suggest(search, history) is None


def test_max_trials_ends_the_search_and_a_rebuild_repeats_the_same_suggestion():
    search = parse_search({"space": SPACE, "max_trials": 3, "seed": 5, "algorithm": "tpe"})
    history = []
    for _ in range(3):
        s = suggest(search, history)
        # a restarted control worker rebuilds the same study and gets the same next trial
        assert suggest(search, list(history)) == s
        history.append(PastTrial(s.number, s.params, "running"))
    assert suggest(search, history) is None
