"""A Slurm pool's settings (`SlurmSettings`, re-exported by `trainyard.slurm`): where the CLI runs
(locally or over SSH), what every job asks Slurm for, how Trainyard priorities map onto Slurm's
partitions, QOS and nice values. Each field checked on its own, with a message that names it;
`settings_errors` answers {"field.path": "message"} for a form or an API (empty when fine).

Pure (pydantic + stdlib): the control plane stores `model_dump(mode="json")` and validates it again
with `SlurmSettings.model_validate` whenever it builds the backend.
"""
from __future__ import annotations

import posixpath
import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

# Partition, account and QOS names (Slurm allows more, but nothing a pool needs).
NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# A path Slurm and a remote shell take as written: absolute, no whitespace, quotes, `%` (sbatch's
# --output pattern character), `..` or empty components.
_PATH_RE = re.compile(r"/[A-Za-z0-9_.+@/-]{0,1023}")
_LOGIN_RE = re.compile(r"(?:[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}@)?[A-Za-z0-9][A-Za-z0-9.-]{0,252}")
_MEM_RE = re.compile(r"[1-9][0-9]{0,8}[KMGT]?")
_GRES_RE = re.compile(r"[A-Za-z0-9_]{1,32}(?::[A-Za-z0-9_.-]{1,64})?")
_ARG_VALUE_RE = re.compile(r"[A-Za-z0-9_.,:@/|&!*+=\[\]()-]{1,256}")
# Signals a job may be sent as a notice (KILL and STOP cannot be caught: no notice at all).
SIGNALS = frozenset({"HUP", "INT", "QUIT", "USR1", "USR2", "TERM", "ALRM", "CONT", "URG", "XCPU", "PWR"})
# sbatch's long options a pool may add to every job: those taking a value, and flags.
EXTRA_WITH_VALUE = ("--constraint", "--exclude", "--nodelist", "--reservation", "--mem-per-cpu", "--licenses",
                    "--gpu-bind", "--cluster-constraint", "--switches", "--prefer", "--distribution")
EXTRA_FLAGS = ("--exclusive", "--contiguous", "--spread-job", "--reboot")
MAX_BANDS = 32


def _path(value: str, what: str) -> str:
    if not _PATH_RE.fullmatch(value):
        raise ValueError(f"{what} must be an absolute path of letters, digits and _.+@/- only "
                         f"(no spaces, quotes or %), got {value!r}")
    if any(part in ("", ".", "..") for part in value.split("/")[1:]) and value != "/":
        raise ValueError(f"{what} must be a normalised absolute path (no '.', '..' or '//'), got {value!r}")
    return value


def _name(value: str, what: str) -> str:
    if value and not NAME_RE.fullmatch(value):
        raise ValueError(f"{what} must be 1-64 letters, digits, '_', '.' or '-', got {value!r}")
    return value


def _signal(value: str) -> str:
    name = value.upper().removeprefix("SIG")
    if name not in SIGNALS:
        raise ValueError(f"not a signal a job can catch: {value!r} (one of {', '.join(sorted(SIGNALS))})")
    return name


def check_extra_arg(arg: str) -> str:
    """One of `extra_args`: a long option of the allowlist, `--opt=value` or a bare flag."""
    opt, eq, value = arg.partition("=")
    if opt in EXTRA_FLAGS and not eq:
        return arg
    if opt in EXTRA_WITH_VALUE and eq:
        if not _ARG_VALUE_RE.fullmatch(value):
            raise ValueError(f"{arg!r}: the value must be 1-256 characters without spaces or quotes")
        return arg
    allowed = ", ".join([f"{o}=..." for o in EXTRA_WITH_VALUE] + list(EXTRA_FLAGS))
    raise ValueError(f"sbatch option {arg!r} is not allowed here (allowed: {allowed})")


ExtraArg = Annotated[str, AfterValidator(check_extra_arg)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PriorityBand(_Strict):
    """Gangs whose Trainyard priority is at least `min_priority` (and below the next band's) go to
    this band's partition and QOS (when set) with this nice value."""

    min_priority: int
    qos: str | None = None
    partition: str | None = None
    nice: int | None = Field(None, description="Slurm's --nice; >= 0 (a negative nice needs root)")

    @field_validator("qos", "partition")
    @classmethod
    def _names(cls, v: str | None, info: ValidationInfo) -> str | None:
        return None if v is None else _name(v, info.field_name) or None

    @field_validator("nice")
    @classmethod
    def _nice(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= 2_147_483_645:
            raise ValueError(f"nice must be >= 0: a negative nice needs root (or SlurmUser) in Slurm, got {v}")
        return v


class SlurmSettings(_Strict):
    state_dir: str = Field(description="absolute directory shared by the submit host and the compute nodes")
    login: str = Field("", description='"" runs the Slurm CLI here; "host" or "user@host" over SSH')
    ssh_key: str = Field("", validate_default=True, description="absolute path of the SSH key (login set)")
    ssh_port: int = Field(22, ge=1, le=65535)
    known_hosts: str = Field("", description="absolute path: StrictHostKeyChecking=yes against it")
    slurm_conf: str = Field("", description="absolute path, exported as SLURM_CONF")
    bin_dir: str = Field("", description='directory of sbatch, squeue, ... ("": PATH)')
    partition: str = ""
    account: str = ""
    qos: str = ""
    time_limit_s: int | None = Field(None, ge=1, le=365 * 86400)
    cpus_per_node: int = Field(0, ge=0, le=100_000)
    mem: str = Field("", description='per node, e.g. "16G" ("": the partition default)')
    gres: str = Field("gpu", description="the GPU gres name (or name:type), requested as --gres=<gres>:<n>")
    priority_map: tuple[PriorityBand, ...] = ()
    command_timeout_s: float = Field(30.0, gt=0, le=600)
    preempt_signal: str = "TERM"
    checkpoint_signal: str = "USR1"
    extra_args: tuple[ExtraArg, ...] = ()

    @field_validator("state_dir")
    @classmethod
    def _state_dir(cls, v: str) -> str:
        _path(v, "state_dir")
        if v == "/":
            raise ValueError("state_dir must be a directory below /, not / itself")
        return v

    @field_validator("ssh_key", "known_hosts", "slurm_conf", "bin_dir")
    @classmethod
    def _optional_paths(cls, v: str, info: ValidationInfo) -> str:
        if info.field_name == "ssh_key" and info.data.get("login") and not v:
            raise ValueError("an SSH key (absolute path) is required when login is set")
        return _path(v, info.field_name) if v else v

    @field_validator("login")
    @classmethod
    def _login(cls, v: str) -> str:
        if v and not _LOGIN_RE.fullmatch(v):
            raise ValueError(f'login must be "host" or "user@host" (letters, digits, _.-; not starting '
                             f"with '-'), got {v!r}")
        return v

    @field_validator("partition", "account", "qos")
    @classmethod
    def _names(cls, v: str, info: ValidationInfo) -> str:
        return _name(v, info.field_name)

    @field_validator("mem")
    @classmethod
    def _mem(cls, v: str) -> str:
        if v and not _MEM_RE.fullmatch(v):
            raise ValueError(f'mem must be a positive integer with an optional unit K, M, G or T (e.g. "16G"), '
                             f"got {v!r}")
        return v

    @field_validator("gres")
    @classmethod
    def _gres(cls, v: str) -> str:
        if not _GRES_RE.fullmatch(v):
            raise ValueError(f'gres must be a gres name or name:type (e.g. "gpu" or "gpu:a100"), got {v!r}')
        return v

    @field_validator("priority_map")
    @classmethod
    def _bands(cls, v: tuple[PriorityBand, ...]) -> tuple[PriorityBand, ...]:
        if len(v) > MAX_BANDS:
            raise ValueError(f"at most {MAX_BANDS} priority bands, got {len(v)}")
        seen = [b.min_priority for b in v]
        if len(set(seen)) != len(seen):
            raise ValueError(f"two priority bands have the same min_priority: {sorted(seen)}")
        return tuple(sorted(v, key=lambda b: b.min_priority))

    @field_validator("preempt_signal", "checkpoint_signal")
    @classmethod
    def _signals(cls, v: str) -> str:
        return _signal(v)

    @field_validator("extra_args")
    @classmethod
    def _extra(cls, v: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        for arg in v:
            if arg.startswith("--mem-per-cpu=") and info.data.get("mem"):
                raise ValueError("--mem-per-cpu and mem exclude each other (sbatch refuses both)")
        return v

    def band(self, priority: int) -> PriorityBand | None:
        """The band of this priority: the highest whose min_priority <= priority (None: none)."""
        chosen = None
        for b in self.priority_map:  # sorted by min_priority
            if b.min_priority <= priority:
                chosen = b
        return chosen

    def job_dir(self, tag: str) -> str:
        return posixpath.join(self.state_dir, tag)


def _path_of(loc: tuple) -> str:
    return ".".join(str(p) for p in loc)


def settings_errors(data: Any) -> dict[str, str]:
    """{"field.path": "message"} for settings SlurmSettings refuses, {} for good ones."""
    if not isinstance(data, dict):
        return {"": f"the settings must be an object, got {type(data).__name__}"}
    try:
        SlurmSettings.model_validate(data)
    except ValidationError as e:
        out: dict[str, str] = {}
        for err in e.errors():
            path = _path_of(err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = f"unknown setting {path!r}"
            out[path] = f"{out[path]}; {msg}" if path in out else msg
        return out
    return {}
