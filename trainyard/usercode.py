"""The user-code sections of the JobSpec (trainyard/spec.py): `code`, `entrypoint`, `env`, `python`,
`config`. A job runs either a built-in model or an entrypoint, never both (docs/architecture.md,
"Contracts"; the rules relating these to the rest of the spec are in `spec.RULES`).

Each field here is bounded on its own (size caps, name patterns, refused environment names), so
a spec that parses is small enough to store, to send in a Launch and to put in an environment.
"""
from __future__ import annotations

import json
import posixpath
import re
from typing import Annotated, Any

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints,
                      field_validator)

from .textdoc import nesting_depth

BUNDLE_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
ENV_NAME_RE = re.compile(r"^[A-Z_][A-Z0-9_]*$")

MAX_ARGS = 256            # entrypoint.args: count
MAX_ARG_CHARS = 4096      # entrypoint.args: each
MAX_PATH_CHARS = 1024     # entrypoint.script, python
MAX_ENV = 64              # env: count
MAX_ENV_NAME_CHARS = 128
MAX_ENV_VALUE_CHARS = 4096
MAX_CONFIG_BYTES = 64 * 1024  # config: serialized as compact JSON (UTF-8)
MAX_CONFIG_DEPTH = 32  # config: nested objects/lists (deeper would exhaust the recursion of json and pydantic)

# Set by torchrun for every rank: a user value would give the rank a wrong identity.
TORCHRUN_ENV = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                          "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE",
                          "MASTER_ADDR", "MASTER_PORT"})
# Set by the agent's launcher (workers/launch_spec.py): devices and cores belong to the slots.
AGENT_ENV = frozenset({"CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "PYTHONPATH", "PYTHONHOME"})
REFUSED_ENV_PREFIXES = ("TRAINYARD_", "TORCHELASTIC_", "PET_", "LD_")


# Arguments and environment values are passed exactly as written: never stripped.
RawStr = Annotated[str, StringConstraints(strip_whitespace=False)]


class _Strict(BaseModel):  # the JobSpec sections' base (spec._Strict): unknown keys are errors
    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=True)


def env_name_problem(name: str) -> str | None:
    """Why `name` may not be set through the spec's env, or None when it may."""
    if not ENV_NAME_RE.match(name) or len(name) > MAX_ENV_NAME_CHARS:
        return (f"env name {name[:MAX_ENV_NAME_CHARS]!r} must match [A-Z_][A-Z0-9_]* "
                f"(at most {MAX_ENV_NAME_CHARS} characters)")
    if name in TORCHRUN_ENV or name.startswith(("TORCHELASTIC_", "PET_")):
        return f"env {name} is set by torchrun for every rank; it cannot be overridden"
    if name in AGENT_ENV or name.startswith(("TRAINYARD_", "LD_")):
        return f"env {name} is set by Trainyard's launcher (or changes what code is loaded); it cannot be set"
    return None


def _scalar_str(v: Any, what: str) -> Any:
    # YAML reads `--epochs 3` as an int and `1e-3` as a float: both mean their text here.
    if isinstance(v, bool) or v is None or isinstance(v, (list, dict)):
        raise ValueError(f"{what} must be a string or a number, got {json.dumps(v)[:40]}")
    return str(v) if isinstance(v, (int, float)) else v


def _no_nul(v: str, what: str) -> str:
    if "\x00" in v:
        raise ValueError(f"{what} must not contain NUL characters")
    return v


def _check_env(v: Any) -> Any:
    if not isinstance(v, dict):
        raise ValueError("env must be a mapping of NAME: value")
    if len(v) > MAX_ENV:
        raise ValueError(f"env has {len(v)} variables; the limit is {MAX_ENV}")
    out = {}
    for name, value in v.items():
        problem = env_name_problem(str(name))
        if problem:
            raise ValueError(problem)
        value = _no_nul(_scalar_str(value, f"env {name}"), f"env {name}")
        if len(value) > MAX_ENV_VALUE_CHARS:
            raise ValueError(f"env {name} is {len(value)} characters long; the limit is {MAX_ENV_VALUE_CHARS}")
        out[str(name)] = value
    return out


def _check_python(v: str | None) -> str | None:
    if v is None:
        return v
    _no_nul(v, "python")
    if not v.startswith("/") or len(v) > MAX_PATH_CHARS:
        raise ValueError(f"python must be an absolute path to an interpreter on the nodes "
                         f"(e.g. /opt/envs/nlp/bin/python), got {v[:80]!r}")
    return v


def _check_config(v: dict) -> dict:
    if nesting_depth(v, MAX_CONFIG_DEPTH) > MAX_CONFIG_DEPTH:
        raise ValueError(f"config nests more than {MAX_CONFIG_DEPTH} levels of objects and lists")
    try:
        text = json.dumps(v, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"config must be plain JSON (objects, lists, strings, finite numbers, "
                         f"booleans, null): {exc}") from None
    size = len(text.encode())
    if size > MAX_CONFIG_BYTES:
        raise ValueError(f"config is {size} bytes as JSON; the limit is {MAX_CONFIG_BYTES}")
    return json.loads(text)  # plain JSON types only from here on (no YAML dates, no tuples)


EnvVars = Annotated[dict[str, RawStr], BeforeValidator(_check_env)]
PythonPath = Annotated[str | None, AfterValidator(_check_python)]
Config = Annotated[dict[str, Any], AfterValidator(_check_config)]


class CodeSpec(_Strict):
    """Where the job's code comes from: a stored code bundle (POST /api/v1/code/)."""

    bundle: str = Field(description="sha256:<64 hex>, as the upload answered; unpacked read-only into the "
                                    "attempt's run directory, which becomes the working directory")

    @field_validator("bundle")
    @classmethod
    def _bundle(cls, v: str) -> str:
        if not BUNDLE_RE.match(v):
            raise ValueError("bundle must be sha256:<64 lowercase hex digits>, as POST /api/v1/code/ answered")
        return v


class EntrypointSpec(_Strict):
    """What torchrun runs in every rank: a script or a module (exactly one), with its arguments."""

    script: str | None = Field(None, description="a Python file: relative to the bundle's root with code.bundle, "
                                                 "else an absolute path on the nodes")
    module: str | None = Field(None, description="a module run as `python -m` (looked up in the bundle, then "
                                                 "the node's PYTHONPATH)")
    args: list[Annotated[RawStr, BeforeValidator(lambda v: _scalar_str(v, "each arg"))]] = Field(
        [], max_length=MAX_ARGS, description=f"command-line arguments, passed as they are (no shell); at most "
                                             f"{MAX_ARGS}, each at most {MAX_ARG_CHARS} characters")

    @field_validator("script")
    @classmethod
    def _script(cls, v: str | None) -> str | None:
        if v is None:
            return v
        _no_nul(v, "script")
        norm = posixpath.normpath(v)
        if not v or len(v) > MAX_PATH_CHARS or "\\" in v or norm == "." or norm.split("/")[0] == "..":
            raise ValueError(f"script must be a file path inside the bundle (like train.py or src/train.py), "
                             f"got {v[:80]!r}")
        return norm

    @field_validator("module")
    @classmethod
    def _module(cls, v: str | None) -> str | None:
        if v is not None and (not MODULE_RE.match(v) or len(v) > MAX_PATH_CHARS):
            raise ValueError(f"module must be a dotted Python module name (like mypkg.train), got {v[:80]!r}")
        return v

    @field_validator("args")
    @classmethod
    def _args(cls, v: list[str]) -> list[str]:
        for i, a in enumerate(v):
            _no_nul(a, f"args[{i}]")
            if len(a) > MAX_ARG_CHARS:
                raise ValueError(f"args[{i}] is {len(a)} characters long; the limit is {MAX_ARG_CHARS}")
        return v

    @property
    def target(self) -> str:
        """What runs, for display: the script path, or `-m module`."""
        return self.script if self.script is not None else f"-m {self.module}"
