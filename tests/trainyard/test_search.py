"""The experiment's search block and trial specs (trainyard/search.py): pure, no database."""
import pytest

from trainyard.search import check_space, parse_experiment, parse_search, set_path, trial_spec
from trainyard.spec import SpecError

TEMPLATE = {"name": "exp", "train": {"steps": 40}}


def errors_of(fn, *a, **kw) -> dict[str, list[str]]:
    with pytest.raises(SpecError) as info:
        fn(*a, **kw)
    return info.value.errors


def test_defaults_and_round_trip():
    s = parse_search({"space": {"train.lr": {"loguniform": [1e-5, 1e-2]}},
                      "early_stopping": {"asha": {"min_steps": 10}}})
    assert (s.metric, s.mode, s.algorithm, s.max_trials, s.max_concurrent, s.seed) == ("loss", "min", "random", 10, 2, 0)
    assert s.asha.reduction == 3
    assert s.to_json()["space"] == {"train.lr": {"loguniform": [1e-5, 1e-2]}}
    assert parse_search(s.to_json()) == s


@pytest.mark.parametrize("search,field,text", [
    ({"space": {"train.lr": {"uniform": [1, 0]}}}, "search.space.train.lr", "lo < hi"),
    ({"space": {"train.lr": {"uniform": [1, 1]}}}, "search.space.train.lr", "lo < hi"),
    ({"space": {"train.lr": {"loguniform": [0, 1]}}}, "search.space.train.lr", "lo > 0"),
    ({"space": {"train.lr": {"int": [3, 2]}}}, "search.space.train.lr", "lo < hi"),
    ({"space": {"train.lr": {"choice": []}}}, "search.space.train.lr.choice", "at least 1"),
    ({"space": {"train.lr": {"choice": [1, 1]}}}, "search.space.train.lr", "twice"),
    ({"space": {"train.lr": {"choice": [1], "int": [0, 2]}}}, "search.space.train.lr", "exactly one"),
    ({"space": {"train.lr": {"normal": [0, 1]}}}, "search.space.train.lr.normal", "unknown key"),
    ({"space": {"train.lr": {"uniform": [0, 1]}}, "algorithm": "grid"}, "search.space.train.lr", "continuous"),
    ({"space": {"train.lr": {"choice": [1]}}, "algorithm": "bayes"}, "search.algorithm", "random"),
    ({"space": {"train.lr": {"choice": [1]}}, "mode": "lowest"}, "search.mode", "min"),
    ({"space": {"train.lr": {"choice": [1]}}, "metric": "val loss"}, "search.metric", "run.log"),
    ({"space": {"train.lr": {"choice": [1]}}, "max_trials": 0}, "search.max_trials", "greater"),
    ({"space": {"train.lr": {"choice": [1]}}, "max_concurrent": 0}, "search.max_concurrent", "greater"),
    ({"space": {"train.lr": {"choice": [1]}}, "early_stopping": {"asha": {"min_steps": 0}}},
     "search.early_stopping.asha.min_steps", "greater"),
    ({"space": {"train.lr": {"choice": [1]}}, "early_stopping": {"asha": {"min_steps": 5, "reduction": 1}}},
     "search.early_stopping.asha.reduction", "greater"),
    ({"space": {"train.lr": {"choice": [1]}}, "early_stopping": {"hyperband": {}}}, "search.early_stopping.hyperband",
     "unknown key"),
    ({"space": {"train.lr": {"choice": [1]}}, "budget": 3}, "search.budget", "unknown key"),
    ({"space": {}}, "search.space", "at least 1"),
    ({"space": {"train": {"choice": [{}]}, "train.lr": {"choice": [1]}}}, "search.space", "overlap"),
    ({"space": {"name": {"choice": ["a", "b"]}}}, "search.space", "name"),
    ({"space": {"train..lr": {"choice": [1]}}}, "search.space", "dotted"),
    ({"space": {"model.layers": {"int": [1, 200]}, "train.warmup_steps": {"int": [0, 200]}}, "algorithm": "grid"},
     "search.space", "more than"),
])
def test_bad_searches_name_their_field(search, field, text):
    errors = errors_of(parse_search, search)
    assert field in errors, errors
    assert any(text in m for m in errors[field]), errors


def test_grid_sizes():
    s = parse_search({"algorithm": "grid", "max_trials": 100,
                      "space": {"model.layers": {"choice": [1, 2]}, "train.warmup_steps": {"int": [0, 2]}}})
    assert s.grid_size() == 6 and s.total_trials() == 6
    assert parse_search({**s.to_json(), "max_trials": 4}).total_trials() == 4


def test_set_path_makes_objects_and_refuses_to_descend_into_values():
    assert set_path({"name": "x"}, "train.lr", 0.1) == {"name": "x", "train": {"lr": 0.1}}
    assert set_path({"config": {"a": 1}}, "config.b.c", [1]) == {"config": {"a": 1, "b": {"c": [1]}}}
    with pytest.raises(ValueError, match="parallel is \"auto\""):
        set_path({"parallel": "auto"}, "parallel.dp", 2)


def test_trial_spec_sets_values_and_validates():
    spec = trial_spec(TEMPLATE, {"train.lr": 0.01, "model.layers": 2}, name="exp-t3")
    assert (spec.name, spec.train.lr, spec.model.layers, spec.train.steps) == ("exp-t3", 0.01, 2, 40)
    assert errors_of(trial_spec, TEMPLATE, {"model.layers": 0}, name="x") == {
        "model.layers": ["Input should be greater than or equal to 1"]}


@pytest.mark.parametrize("space,field,text", [
    ({"train.lrx": {"choice": [0.1]}}, "search.space.train.lrx", "unknown key"),     # a path the JobSpec lacks
    ({"lr": {"choice": [0.1]}}, "search.space.lr", "unknown key"),
    ({"train.lr": {"uniform": [-1.0, 0.1]}}, "search.space.train.lr", "greater than 0"),     # the first bound
    ({"model.layers": {"choice": [2, 4, 0]}}, "search.space.model.layers", "the value 0"),    # a later choice
    ({"model.layers": {"int": [1, 100000]}}, "search.space.model.layers", "the value 100000"),  # the upper bound
    ({"config.lr": {"choice": [0.1]}}, "search.space.config.lr", "entrypoint"),   # a cross-field rule
    ({"parallel.dp": {"choice": [1, 2]}}, "search.space.parallel.dp", "must equal the number of processes"),
])
def test_check_space_tries_every_choice_and_bound_against_the_jobspec(space, field, text):
    errors = check_space(TEMPLATE, parse_search({"space": space}))
    assert field in errors, errors
    assert any(text in m for m in errors[field]), errors


def test_check_space_passes_a_good_space_and_blames_a_bad_template_on_spec():
    good = parse_search({"space": {"train.lr": {"loguniform": [1e-5, 1e-2]}, "model.layers": {"choice": [1, 2]},
                                   "train.warmup_steps": {"int": [0, 5]}}})
    assert check_space(TEMPLATE, good) == {}
    errors = check_space({"name": "x", "train": {"steps": -1}}, good)
    assert list(errors) == ["spec.train.steps"]


def test_parse_experiment_reports_template_and_search_together():
    errors = errors_of(parse_experiment, "not a spec", {"space": {}})
    assert set(errors) == {"spec", "search.space"}
