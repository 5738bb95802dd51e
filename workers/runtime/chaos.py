"""Test-only fault injection: hangs, stragglers and crashes on cue. Off unless the environment
sets TRAINYARD_CHAOS_DIR; then the runtime reads `<dir>/job-<job_id>.json` if it exists:

    {"hang_at_step": 7,    "hang_rank": 0,    # after reporting step 7, that rank sleeps forever
     "slow_rank": 1,       "slow_s": 0.2,     # that rank sleeps 0.2 s per step in its compute phase
     "exit_at_step": 9,    "exit_rank": 0,    # after step 9, that rank calls os._exit(137)
     "raise_at_step": 4,   "raise_rank": 1}   # after step 4, that rank raises ChaosError (an
                                              # uncaught error while its peers enter a collective)

Every key is optional (null or absent: off). The file is re-read when it changes (one os.stat
per step, ~2 us), so a test can turn slowness off mid-run and watch the job recover; write it
with os.replace so a half-written file is never seen (an unparsable one is retried next step).
A hang, an exit or a raise fires once per job: before firing, the rank creates `<dir>/job-<id>.hang-fired`
(`.exit-fired`, `.raise-fired`) with O_CREAT|O_EXCL, and if that file exists it does not fire, so the
attempt that restarts the job runs through the same step.

Where the effects land in the telemetry: the slow sleep sits between fetching the batch and the
forward pass, so it is in the slow rank's compute_s; its peers wait for it inside their gradient
all-reduces, which is exposed comm (in their comm_s and step_s, not their compute_s).

The slow knob (a test aid for load balancing, trainyard/sdk/balance.py): a factor f >= 1 that makes a rank's
compute take f times as long *in proportion to its work*, like a slower device. Before its
forward pass the rank sleeps (f - 1) x n x its own compute time per sample in the previous step
(forward+backward wall time minus the exposed wait for peers' gradients, minus that step's
sleep; n: this step's samples), so compute_s ~= f x the real compute, and halving the rank's
share halves the sleep too (a fixed `slow_s` per step could not be balanced
away). The "sleep" busy-waits, keeping the core occupied as a slower device's compute would: a
rank that really slept left its core idle part of the time, other processes ran there, and on
a loaded 2-core machine (bench/hetero.py, load average ~4) its compute per sample under
balancing came out 54-63 ms instead of the ~23 ms it took with an equal split; busy-waiting,
26-30 ms (2x its peer's, as intended). Two ways to set it, the chaos file first:
    {"slow_rank": 1, "slow_factor": 2.0}        # in <dir>/job-<id>.json, re-read every step
    TRAINYARD_SLOW_FACTOR_RANK1=2.0             # environment (no chaos dir needed): rank 1, 2x
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

ENV = "TRAINYARD_CHAOS_DIR"
SLOW_ENV = "TRAINYARD_SLOW_FACTOR_RANK{rank}"
EXIT_CODE = 137  # what a SIGKILLed process reports (128 + 9): the OOM killer's signature


@dataclass(frozen=True)
class ChaosPlan:
    hang_at_step: int | None = None
    hang_rank: int = 0
    slow_rank: int | None = None
    slow_s: float = 0.0
    slow_factor: float | None = None  # the slow knob for slow_rank (None: the environment's)
    exit_at_step: int | None = None
    exit_rank: int = 0
    raise_at_step: int | None = None
    raise_rank: int = 0

    @classmethod
    def from_dict(cls, raw: dict) -> "ChaosPlan":
        names = {f.name for f in fields(cls)}
        unknown = set(raw) - names
        if unknown:
            raise ValueError(f"unknown chaos keys {sorted(unknown)}; known: {sorted(names)}")
        defaults = cls()
        # null means "off" (or the default rank), as if the key were absent
        return cls(**{k: (getattr(defaults, k) if v is None else v) for k, v in raw.items()})


class ChaosError(RuntimeError):
    """The error `raise_at_step` raises: an ordinary exception from inside training."""


class Chaos:
    def __init__(self, directory: Path, job_id: int, rank: int, say: Callable[[str], None] = print):
        self.dir = Path(directory)
        self.job_id, self.rank, self.say = job_id, rank, say
        self.path = self.dir / f"job-{job_id}.json"
        self.plan = ChaosPlan()
        self._seen: tuple | None = None

    @classmethod
    def from_environ(cls, job_id: int, rank: int, say: Callable[[str], None] = print) -> "Chaos | None":
        directory = os.environ.get(ENV, "")
        return cls(Path(directory), job_id, rank, say) if directory else None

    def refresh(self) -> ChaosPlan:
        try:
            st = os.stat(self.path)
            key = (st.st_ino, st.st_mtime_ns, st.st_size)  # os.replace changes the inode
        except FileNotFoundError:
            key = None
        if key != self._seen:
            try:
                self.plan = ChaosPlan.from_dict(json.loads(self.path.read_text())) if key else ChaosPlan()
            except (OSError, json.JSONDecodeError):
                return self.plan  # vanished or half-written: keep the old plan, retry next step
            self._seen = key
        return self.plan

    def before_compute(self, step: int) -> None:
        """Once per step, after the batch is fetched and before the forward pass."""
        plan = self.refresh()
        if plan.slow_rank == self.rank and plan.slow_s > 0:
            time.sleep(plan.slow_s)

    def after_step(self, step: int) -> None:
        """Once per step, after the step's sample was reported (and its checkpoint started)."""
        plan = self.plan
        if plan.exit_at_step == step and plan.exit_rank == self.rank and self._fire("exit"):
            self.say(f"rank {self.rank} chaos: exiting with {EXIT_CODE} after step {step}")
            os._exit(EXIT_CODE)
        if plan.raise_at_step == step and plan.raise_rank == self.rank and self._fire("raise"):
            self.say(f"rank {self.rank} chaos: raising after step {step}")
            raise ChaosError(f"chaos: rank {self.rank} raised after step {step}")
        if plan.hang_at_step == step and plan.hang_rank == self.rank and self._fire("hang"):
            self.say(f"rank {self.rank} chaos: hanging after step {step}")
            while True:  # peers block in the next collective; only a kill ends this
                time.sleep(3600)

    def _fire(self, what: str) -> bool:
        """True once per job and `what`: whoever creates the marker first fires."""
        try:
            os.close(os.open(self.dir / f"job-{self.job_id}.{what}-fired",
                             os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            return False
        return True


def _factor(raw, where: str) -> float:
    try:
        f = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{where} must be a number >= 1, got {raw!r}") from None
    if not (f >= 1.0 and f < float("inf")):
        raise ValueError(f"{where} must be a number >= 1, got {raw!r}")
    return f


class SlowKnob:
    """This rank's slow factor (module docstring): the chaos file's slow_factor when it names
    this rank as slow_rank, else TRAINYARD_SLOW_FACTOR_RANK<rank>, else 1 (off).

    The (busy) wait of a step is (factor - 1) x n x the rank's own compute per sample in its
    previous step (`measured`), before the forward pass (`before_compute`), where chaos' slow_s
    sleeps too: peers wait for it inside their gradient all-reduce (their exposed comm, in their
    step_s), as they would for a slower device. The first step of a process has nothing to go by
    and is not slowed."""

    def __init__(self, chaos: Chaos | None, rank: int, environ=None):
        environ = os.environ if environ is None else environ
        name = SLOW_ENV.format(rank=rank)
        self.chaos, self.rank = chaos, rank
        self.env_factor = _factor(environ[name], name) if environ.get(name) else 1.0
        self.per_sample_s: float | None = None  # own compute per sample, last step
        self.slept_s = 0.0

    @property
    def factor(self) -> float:
        plan = self.chaos.plan if self.chaos is not None else None  # refreshed by before_compute
        if plan is not None and plan.slow_rank == self.rank and plan.slow_factor is not None:
            return _factor(plan.slow_factor, "chaos slow_factor")
        return self.env_factor

    def before_compute(self, n: int) -> None:
        """Once per step, after the batch of n samples is fetched and before the forward pass;
        busy-waits (module docstring)."""
        f = self.factor
        self.slept_s = 0.0
        if f > 1 and self.per_sample_s is not None:
            t = time.perf_counter()
            end = t + (f - 1.0) * n * self.per_sample_s
            while time.perf_counter() < end:  # busy, not asleep: see the module docstring
                pass
            self.slept_s = time.perf_counter() - t

    def measured(self, compute_s: float, n: int) -> None:
        """After the step: its compute_s (forward+backward minus exposed comm, this step's sleep
        included) over its n samples."""
        self.per_sample_s = max(0.0, compute_s - self.slept_s) / n
