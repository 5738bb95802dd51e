"""An experiment's `search` block (issue 25, docs/architecture.md "Experiments"): what to vary, how
to pick the next trial and when to stop one early; and a trial's JobSpec, the template with the
trial's values set by dotted path.

Pure (pydantic + stdlib, no Django): the control plane parses every submitted search with
`parse_search` and checks it against its template with `check_space` (SpecError at
`search.<field>` or `spec.<field>`, HTTP 400); `trial_spec` builds each trial's JobSpec.

    search: {metric: loss, mode: min, algorithm: random | grid | tpe, max_trials: 6,
             max_concurrent: 2, seed: 0,
             space: {train.lr: {loguniform: [1e-5, 1e-2]}, model.layers: {choice: [2, 4]},
                     train.warmup_steps: {int: [0, 50]}, config.dropout: {uniform: [0.0, 0.3]}},
             early_stopping: {asha: {min_steps: 20, reduction: 2}}}
"""
from __future__ import annotations

import copy
import itertools
import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .rules import SpecError
from .spec import JobSpec, parse_job_spec

MAX_SPACE = 16          # parameters one search may vary
MAX_CHOICES = 100       # values one choice may list
MAX_TRIALS = 1000
MAX_CONCURRENT = 64
MAX_GRID = 10_000       # grid points (the product of the choices and int ranges)
_PATH_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Domain(_Strict):
    """One parameter's range: exactly one of choice, uniform, loguniform, int."""

    choice: list[Any] | None = Field(None, min_length=1, max_length=MAX_CHOICES,
                                     description="the values to try (any JSON values)")
    uniform: tuple[float, float] | None = Field(None, description="[lo, hi]: a float drawn uniformly")
    loguniform: tuple[float, float] | None = Field(None, description="[lo, hi], lo > 0: a float drawn "
                                                                     "uniformly in log space")
    int_: tuple[int, int] | None = Field(None, alias="int", description="[lo, hi]: an integer, both included")

    @model_validator(mode="after")
    def _one_kind(self) -> Domain:
        given = [k for k in ("choice", "uniform", "loguniform", "int_") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of choice, uniform, loguniform, int")
        lo_hi = self.uniform or self.loguniform or self.int_
        if lo_hi is not None:
            lo, hi = lo_hi
            if not (math.isfinite(lo) and math.isfinite(hi)):
                raise ValueError("bounds must be finite numbers")
            if not lo < hi:
                raise ValueError(f"needs lo < hi, got [{lo}, {hi}]")
            if self.loguniform is not None and lo <= 0:
                raise ValueError(f"loguniform needs lo > 0 (log of {lo} is undefined)")
        if self.choice is not None:
            seen = [json.dumps(v, sort_keys=True) for v in self.choice]
            if len(set(seen)) != len(seen):
                raise ValueError("choice lists a value twice")
        return self

    @property
    def kind(self) -> Literal["choice", "uniform", "loguniform", "int"]:
        if self.choice is not None:
            return "choice"
        if self.uniform is not None:
            return "uniform"
        return "loguniform" if self.loguniform is not None else "int"

    @property
    def bounds(self) -> tuple[float, float]:
        lo_hi = self.uniform or self.loguniform or self.int_
        assert lo_hi is not None
        return lo_hi

    def grid(self) -> list[Any] | None:
        """The values a grid search tries; None for a continuous range."""
        if self.choice is not None:
            return list(self.choice)
        if self.int_ is not None:
            return list(range(self.int_[0], self.int_[1] + 1))
        return None

    def edges(self) -> list[Any]:
        """The values checked against the template at submit: every choice, or both bounds."""
        if self.choice is not None:
            return list(self.choice)
        return list(self.bounds)


class Asha(_Strict):
    min_steps: int = Field(ge=1, le=10_000_000, description="the first rung: trials are compared at "
                                                             "min_steps * reduction**k")
    reduction: int = Field(3, ge=2, le=100, description="keep the top 1/reduction of the trials at each rung")


class EarlyStopping(_Strict):
    asha: Asha | None = Field(None, description="asynchronous successive halving")


class SearchSpec(_Strict):
    """A whole search. `space` maps dotted JobSpec paths (`train.lr`, `config.dropout`) to ranges."""

    metric: str = Field("loss", min_length=1, max_length=64,
                        description="what the trials report: `loss` (the built-in trainer's and run.log's "
                                    "loss) or a name given to run.log(step, name=...)")
    mode: Literal["min", "max"] = "min"
    space: dict[str, Domain] = Field(min_length=1, max_length=MAX_SPACE)
    algorithm: Literal["random", "grid", "tpe"] = "random"
    max_trials: int = Field(10, ge=1, le=MAX_TRIALS)
    max_concurrent: int = Field(2, ge=1, le=MAX_CONCURRENT)
    seed: int = Field(0, ge=0, le=2**31 - 1)
    early_stopping: EarlyStopping | None = None

    @field_validator("metric")
    @classmethod
    def _metric_name(cls, v: str) -> str:
        if not (v[0].isalpha() or v[0] == "_") or not all(c.isalnum() or c == "_" for c in v):
            raise ValueError("a metric is a name as run.log takes it ([A-Za-z_][A-Za-z0-9_]*)")
        return v

    @field_validator("space")
    @classmethod
    def _paths(cls, v: dict[str, Domain]) -> dict[str, Domain]:
        for path in v:
            parts = path.split(".")
            if not path or set(path) - _PATH_CHARS or any(not p for p in parts) or len(parts) > 8:
                raise ValueError(f"{path!r} is not a dotted JobSpec path (like train.lr or config.dropout)")
            if parts[0] == "name":
                raise ValueError("a trial's name is set by its experiment")
        for a, b in itertools.permutations(v, 2):
            if b.startswith(a + "."):
                raise ValueError(f"{a} and {b} overlap: {b} lies inside {a}")
        return v

    @model_validator(mode="after")
    def _grid(self) -> SearchSpec:
        if self.algorithm == "grid":
            size = 1
            for path, d in self.space.items():
                g = d.grid()
                if g is None:
                    raise _PathError(f"space.{path}", f"a grid cannot enumerate a continuous {d.kind} "
                                                      "range: use choice or int, or algorithm random or tpe")
                size *= len(g)
            if size > MAX_GRID:
                raise _PathError("space", f"the grid has {size} points, more than {MAX_GRID}")
        return self

    @property
    def asha(self) -> Asha | None:
        return self.early_stopping.asha if self.early_stopping is not None else None

    def grid_size(self) -> int | None:
        if self.algorithm != "grid":
            return None
        return math.prod(len(d.grid() or ()) for d in self.space.values())

    def total_trials(self) -> int:
        """How many trials the search runs at most (a grid stops when exhausted)."""
        g = self.grid_size()
        return self.max_trials if g is None else min(self.max_trials, g)

    def to_json(self) -> dict:
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class _PathError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def parse_search(data: Any) -> SearchSpec:
    """`data` (a parsed JSON/YAML mapping) as a SearchSpec, or SpecError at `search.<field>`."""
    if not isinstance(data, dict):
        raise SpecError({"search": ["a search must be an object with metric, mode, space, algorithm, ..."]})
    try:
        return SearchSpec.model_validate(data)
    except ValidationError as exc:
        errors: dict[str, list[str]] = {}
        for err in exc.errors(include_url=False):
            ctx = (err.get("ctx") or {}).get("error")
            if isinstance(ctx, _PathError):
                errors.setdefault(f"search.{ctx.field}", []).append(str(ctx))
                continue
            loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-"))
            msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
            errors.setdefault("search" + (f".{loc}" if loc else ""), []).append(msg)
        raise SpecError(errors) from None


def set_path(spec: dict, path: str, value: Any) -> dict:
    """A copy of `spec` (a JobSpec mapping) with `value` at the dotted `path` (missing objects are
    made). ValueError when a part of the path is not an object in the template."""
    out = copy.deepcopy(spec)
    node = out
    parts = path.split(".")
    for i, part in enumerate(parts[:-1]):
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            raise ValueError(f"{'.'.join(parts[:i + 1])} is {json.dumps(nxt)[:60]} in the spec, not an object")
        node = nxt
    node[parts[-1]] = copy.deepcopy(value)
    return out


def trial_spec(template: dict, values: dict[str, Any], *, name: str, data_root=None) -> JobSpec:
    """The JobSpec of one trial: `template` with each value set at its dotted path and `name`,
    validated like a submitted spec (SpecError naming the spec's field)."""
    spec = dict(template, name=name)
    for path, value in values.items():
        try:
            spec = set_path(spec, path, value)
        except ValueError as exc:
            raise SpecError({path: [str(exc)]}) from None
    return parse_job_spec(spec, data_root=data_root)


def check_space(template: dict, search: SearchSpec, *, data_root=None) -> dict[str, list[str]]:
    """Whether every trial the search can make is a valid JobSpec: the template with the first
    value of every parameter, then each choice and each bound of one parameter at a time. Errors
    as SpecError.errors: `spec.<field>` for the template itself, `search.space.<path>` for a path
    the JobSpec does not have or a value it refuses."""
    base = {p: d.edges()[0] for p, d in search.space.items()}
    try:
        trial_spec(template, base, name="check", data_root=data_root)
    except SpecError as exc:
        errors: dict[str, list[str]] = {}
        for field, msgs in exc.errors.items():
            hit = next((p for p in search.space if field == p or field.startswith(p + ".") or p.startswith(field + ".")),
                       None)
            key = f"search.space.{hit}" if hit else f"spec.{field}"
            errors.setdefault(key, []).extend(msgs)
        return errors
    errors = {}
    for path, d in search.space.items():
        for value in d.edges()[1:]:
            try:
                trial_spec(template, {**base, path: value}, name="check", data_root=data_root)
            except SpecError as exc:
                msgs = "; ".join(f"{f}: {' '.join(m)}" for f, m in exc.errors.items())
                errors.setdefault(f"search.space.{path}", []).append(
                    f"the value {json.dumps(value)[:60]} makes an invalid job ({msgs})")
                break
    return errors


def parse_experiment(spec: Any, search: Any, *, data_root=None) -> tuple[dict, SearchSpec]:
    """A submitted experiment's template (its defaults filled in) and search, checked together,
    or SpecError naming every bad field (`spec.*`, `search.*`)."""
    errors: dict[str, list[str]] = {}
    parsed: SearchSpec | None = None
    if not isinstance(spec, dict):
        errors["spec"] = ["the template must be a JobSpec object"]
    try:
        parsed = parse_search(search)
    except SpecError as exc:
        errors.update(exc.errors)
    if errors or parsed is None:
        raise SpecError(errors)
    errors = check_space(spec, parsed, data_root=data_root)
    if errors:
        raise SpecError(errors)
    return dict(spec), parsed


def default_name(spec: dict) -> str:
    name = spec.get("name") if isinstance(spec, dict) else None
    return name if isinstance(name, str) and name else "experiment"


__all__ = ["Asha", "Domain", "JobSpec", "SearchSpec", "check_space", "parse_experiment", "parse_search",
           "set_path", "trial_spec"]


def experiment_document(doc: object) -> dict:
    """{name, spec, search} from an experiment document (a file the CLI reads, the form's text):
    either that mapping as the API takes it, or a JobSpec with a top-level `search` block (the
    JobSpec is the template). SpecError with the field the problem is at."""
    if not isinstance(doc, dict):
        raise SpecError({"spec": ["an experiment is a mapping: {name, spec, search}, or a JobSpec with a search "
                                  "block"]})
    if "spec" in doc:
        unknown = sorted(set(doc) - {"name", "spec", "search"})
        if unknown:
            raise SpecError({k: ["unknown key next to spec (expected name, spec, search)"] for k in unknown})
        body = dict(doc)
    else:
        spec = dict(doc)
        search = spec.pop("search", None)
        body = {"name": spec.get("name"), "spec": spec, "search": search}
    if body.get("search") is None:
        raise SpecError({"search": ["no search block (search: {metric, mode, space, algorithm, max_trials, ...})"]})
    try:
        json.dumps(body, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise SpecError({"spec": [f"every value must be plain JSON data ({exc}); quote it as a string"]}) from None
    return body
