"""The next trial's values, from Optuna's samplers (random: RandomSampler, grid: GridSampler over
the choices and int ranges, tpe: TPESampler), over a study rebuilt in memory from the Trial rows.

Nothing of Optuna's is stored: each suggestion builds a fresh in-memory study, adds every past
trial (`create_trial` with its params, state, value and the metric at its ASHA rungs), and asks
once. The sampler is seeded with (search.seed, trial number), so the same history and seed give
the same suggestion (TPE included), a rebuilt study never replays an earlier draw, and a
restarted control worker suggests what the first would have. The suggestion is written in the
same transaction as its trial's job (services/submit.py), and (experiment, number) is unique.

A choice is sampled by its index (Optuna's categorical distributions take only scalars; a choice
may list objects), so `params` holds indices and `values` the chosen values.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from trainyard.search import SearchSpec

optuna.logging.set_verbosity(logging.WARNING)

_STATES = {"running": TrialState.RUNNING, "complete": TrialState.COMPLETE, "pruned": TrialState.PRUNED,
           "fail": TrialState.FAIL}


@dataclass(frozen=True)
class PastTrial:
    number: int
    params: dict[str, Any]                   # the sampler's values (a choice's index)
    state: str                               # running | complete | pruned | fail
    value: float | None = None               # the best metric (complete trials)
    intermediate: dict[int, float] = field(default_factory=dict)   # step -> metric at the ASHA rungs


@dataclass(frozen=True)
class Suggestion:
    number: int
    params: dict[str, Any]
    values: dict[str, Any]


def distributions(search: SearchSpec) -> dict[str, BaseDistribution]:
    out: dict[str, BaseDistribution] = {}
    for path, d in search.space.items():
        if d.kind == "choice":
            out[path] = CategoricalDistribution(tuple(range(len(d.choice or ()))))
        elif d.kind == "int":
            out[path] = IntDistribution(*d.bounds)
        else:
            out[path] = FloatDistribution(*d.bounds, log=d.kind == "loguniform")
    return out


def _seed(search: SearchSpec, number: int) -> int:
    return (search.seed * 1_000_003 + number) % (2**31 - 1)


def _grid(search: SearchSpec) -> dict[str, list]:
    return {path: (list(range(len(d.choice or ()))) if d.kind == "choice" else list(d.grid() or ()))
            for path, d in search.space.items()}


def _sampler(search: SearchSpec, number: int) -> optuna.samplers.BaseSampler:
    seed = _seed(search, number)
    if search.algorithm == "grid":
        grid = _grid(search)
        # the grid's shuffle must be the same on every rebuild (the seed fixes it): trial n takes point n
        return optuna.samplers.GridSampler(grid, seed=search.seed)
    if search.algorithm == "tpe":
        # TPE models the history once it has a few results: a quarter of the budget, 2..10 random first
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=max(2, min(10, search.max_trials // 4)))
    return optuna.samplers.RandomSampler(seed=seed)


def _grid_attrs(search: SearchSpec, number: int) -> dict:
    # what GridSampler marks its own trials with: the history's points count as visited
    return {"search_space": {k: v for k, v in sorted(_grid(search).items())}, "grid_id": number}


def suggest(search: SearchSpec, history: list[PastTrial]) -> Suggestion | None:
    """The next trial (number len(history)), or None when the search has made all its trials
    (max_trials, or every grid point)."""
    number = len(history)
    if number >= search.total_trials():
        return None
    if sorted(t.number for t in history) != list(range(number)):
        raise ValueError("the history must be trials 0..n-1")
    dists = distributions(search)
    study = optuna.create_study(direction="minimize" if search.mode == "min" else "maximize",
                                sampler=_sampler(search, number))
    for t in sorted(history, key=lambda t: t.number):
        state = _STATES[t.state]
        value = t.value if state == TrialState.COMPLETE else None
        if state == TrialState.COMPLETE and value is None:
            state = TrialState.FAIL  # it finished without reporting the metric: nothing to model
        study.add_trial(optuna.trial.create_trial(
            state=state, value=value, params=dict(t.params), distributions=dists,
            intermediate_values={int(k): float(v) for k, v in t.intermediate.items()},
            system_attrs=_grid_attrs(search, t.number) if search.algorithm == "grid" else None))
    trial = study.ask()
    assert trial.number == number, (trial.number, number)
    params: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for path, d in search.space.items():
        dist = dists[path]
        if isinstance(dist, CategoricalDistribution):
            idx = trial.suggest_categorical(path, list(dist.choices))
            params[path], values[path] = idx, (d.choice or [])[int(idx)]
        elif isinstance(dist, IntDistribution):
            params[path] = values[path] = trial.suggest_int(path, dist.low, dist.high)
        else:
            v = trial.suggest_float(path, dist.low, dist.high, log=dist.log)
            params[path], values[path] = v, v
    return Suggestion(number=number, params=params, values=values)
