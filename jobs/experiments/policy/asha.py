"""ASHA, asynchronous successive halving (Li et al. 2020, "A System for Massively Parallel
Hyperparameter Tuning"), as a stopping rule: trials are compared at rungs `min_steps *
reduction**k`; a trial whose metric at a rung is not in the top 1/reduction of all the trials
that reached that rung so far is stopped. Asynchronous: each trial is judged once per rung, when
it reaches it, against whoever reached it before (so the first trial at a rung always goes on,
and no trial waits for slower ones); a stopped trial frees its slots for the next suggestion.

Pure: frozen dataclasses in, frozen dataclasses out; jobs/experiments/services/advance.py reads
the trials' metrics and applies the decisions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class AshaConfig:
    min_steps: int
    reduction: int
    max_steps: int       # the trials' train.steps: no rung at or past the end (finishing is the last word)
    mode: str = "min"    # "min" | "max"


@dataclass(frozen=True)
class TrialRungs:
    """One trial as ASHA sees it: the metric at each rung it reached (rung index -> value), the
    last step it reported, and whether it still runs (only running trials can be stopped)."""

    trial: int
    values: tuple[tuple[int, float], ...]   # ((rung, value), ...)
    step: int
    running: bool
    judged: int | None = None               # the highest rung this trial was already judged at


@dataclass(frozen=True)
class Decision:
    trial: int
    rung: int
    step: int          # the rung's step
    stop: bool
    value: float
    cutoff: float      # the worst value kept at this rung
    peers: int         # trials that reached this rung (this one included)
    keep: int          # how many of them are kept


def rungs(cfg: AshaConfig) -> tuple[int, ...]:
    """The rungs' steps: min_steps * reduction**k below max_steps."""
    out = []
    step = cfg.min_steps
    while step < cfg.max_steps and len(out) < 64:
        out.append(step)
        step *= cfg.reduction
    return tuple(out)


def rung_reached(cfg: AshaConfig, step: int) -> int | None:
    """The highest rung index a trial that reported `step` has reached, or None below the first."""
    r = [k for k, s in enumerate(rungs(cfg)) if step >= s]
    return r[-1] if r else None


def decide(cfg: AshaConfig, trials: tuple[TrialRungs, ...]) -> tuple[Decision, ...]:
    """One decision per running trial and rung it has a value for and was not judged at yet,
    lowest rung first; a trial stopped at a rung is not judged at a higher one. `keep` is
    ceil(peers / reduction): with 2 peers and reduction 2 the better one goes on."""
    at: dict[int, list[tuple[int, float]]] = {}
    for t in trials:
        for rung, value in t.values:
            if not math.isnan(value):
                at.setdefault(rung, []).append((t.trial, value))
    out = []
    steps = rungs(cfg)
    for t in sorted(trials, key=lambda x: x.trial):
        if not t.running:
            continue
        for rung, value in sorted(t.values):
            if (t.judged is not None and rung <= t.judged) or rung >= len(steps):
                continue
            peers = at.get(rung, [])
            keep = max(1, math.ceil(len(peers) / cfg.reduction))
            ranked = sorted(peers, key=lambda p: (p[1] if cfg.mode == "min" else -p[1], p[0]))
            kept = ranked[:keep]
            stop = math.isnan(value) or all(p[0] != t.trial for p in kept)
            # a NaN (diverged) first trial at its rung has no peer to compare with: cutoff NaN
            out.append(Decision(trial=t.trial, rung=rung, step=steps[rung], stop=stop, value=value,
                                cutoff=kept[-1][1] if kept else math.nan, peers=len(peers), keep=keep))
            if stop:
                break
    return tuple(out)


def best(mode: str, values: tuple[tuple[int, float], ...]) -> tuple[int, float] | None:
    """The (trial, value) with the best value, ties to the lower trial; None without values."""
    real = [(t, v) for t, v in values if v is not None and not math.isnan(v)]
    if not real:
        return None
    return min(real, key=lambda p: (p[1] if mode == "min" else -p[1], p[0]))


__all__ = ["AshaConfig", "Decision", "TrialRungs", "best", "decide", "rung_reached", "rungs"]
