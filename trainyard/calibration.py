"""The calibration measurement document: what `python -m workers.calibrate` writes on a node and
what the control plane fits its cost-model constants on (trainyard/plan/calibration.py).

It crosses the bus (a node's calibration report comes back through a control-queue task), so,
like trainyard/launch.py's messages, both sides validate it with this one model: the harness
before writing it, the control plane before fitting or storing it. Unknown keys are errors.

Units: bytes, seconds, TFLOP/s (10^12 floating-point operations per second, a multiply-add
counting 2). A collective's `bytes` is the size of the whole tensor the collective is about,
nccl-tests' "size": all_reduce's buffer, all_gather's output, reduce_scatter's input,
send_recv's message.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

VERSION = 1
OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DeviceInfo(_Strict):
    name: str = Field(min_length=1, max_length=200, description='"cpu" or the CUDA device name')
    kind: Literal["cpu", "cuda"]
    procs: int = Field(ge=1, le=4096, description="ranks of the collective and run measurements")
    threads_per_proc: int = Field(ge=1, le=4096, description="intra-op threads of each rank")
    host: str = Field(max_length=255)
    torch: str = Field(max_length=64)


class MatmulPoint(_Strict):
    m: int = Field(ge=1, le=1 << 20)
    k: int = Field(ge=1, le=1 << 20)
    n: int = Field(ge=1, le=1 << 20)
    dtype: Literal["float32", "bfloat16", "float16"]
    tflops: float = Field(gt=0, le=1e5)


class CollectivePoint(_Strict):
    op: Literal["all_reduce", "all_gather", "reduce_scatter", "send_recv"]
    group: int = Field(ge=2, le=1 << 20)
    link: Literal["intra", "inter"]
    bytes: int = Field(ge=1, le=1 << 40)
    seconds: float = Field(gt=0, le=3600)


class RunModel(_Strict):
    layers: int = Field(ge=1, le=10_000)
    hidden: int = Field(ge=1, le=1_000_000)
    heads: int = Field(ge=1, le=100_000)
    seq_len: int = Field(ge=1, le=10_000_000)
    vocab: int = Field(ge=2, le=10_000_000)


class RunPlan(_Strict):
    dp: int = Field(ge=1)
    tp: int = Field(ge=1)
    pp: int = Field(ge=1)
    micro_batch: int = Field(ge=1)
    fsdp: bool
    shard_optimizer: bool
    recompute: Literal["none", "full"]
    schedule: Literal["gpipe", "1f1b"]


class RunMemory(_Strict):
    """Bytes one rank holds (local shards under FSDP/TP/PP), the largest over the ranks."""

    params_bytes: int = Field(ge=0)
    grads_bytes: int = Field(ge=0)
    optimizer_bytes: int = Field(ge=0)
    activation_bytes: int = Field(ge=0, description="unique storages saved for backward by one "
                                                    "micro-batch's forward and loss, parameters excluded")


class Run(_Strict):
    model: RunModel
    global_batch: int = Field(ge=1)
    plan: RunPlan
    procs: int = Field(ge=1)
    step_time_s: float = Field(gt=0, description="median over the warm steps of the slowest rank's step "
                                                 "(the smallest over the passes)")
    steps: int = Field(ge=1, description="steps run in each pass, the first ones (warm-up) included")
    passes: int = Field(1, ge=1, le=100, description="times the grid point was run (a pass over the grid each)")
    memory: RunMemory


class Measurements(_Strict):
    version: Literal[1]
    device: DeviceInfo
    matmul: list[MatmulPoint] = Field(min_length=1, max_length=10_000)
    collectives: list[CollectivePoint] = Field(default_factory=list, max_length=100_000)
    runs: list[Run] = Field(default_factory=list, max_length=10_000)


class MeasurementsError(ValueError):
    """An invalid measurement document; `errors` maps field paths to messages."""

    def __init__(self, errors: dict[str, list[str]]):
        self.errors = errors
        first = next(iter(errors.items()))
        super().__init__(f"{first[0]}: {first[1][0]}")


def parse_measurements(data: object) -> Measurements:
    """The validated document; MeasurementsError naming the fields otherwise."""
    if not isinstance(data, dict):
        raise MeasurementsError({"measurements": ["must be a JSON object"]})
    try:
        return Measurements.model_validate(data)
    except ValidationError as e:
        errors: dict[str, list[str]] = {}
        for err in e.errors():
            path = ".".join(str(p) for p in err["loc"]) or "measurements"
            errors.setdefault(path, []).append(err["msg"])
        raise MeasurementsError(errors) from None


class HarnessFailed(RuntimeError):
    """`python -m workers.calibrate` exited non-zero, timed out or wrote an invalid document."""


HARNESS_TIMEOUT_S = {True: 400, False: 1500}  # quick, default: the harness's own limits + start-up


def run_harness(*, quick: bool, python: str, cwd: str, timeout_s: float | None = None) -> tuple[dict, dict]:
    """Run the harness as a subprocess (argv list, no shell) of interpreter `python` in `cwd`
    (where `workers` is importable); (the validated document, its summary line: wall times)."""
    import json
    import subprocess
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="trainyard-calibration-") as tmp:
        out = Path(tmp) / "measurements.json"
        limit = timeout_s or HARNESS_TIMEOUT_S[quick]
        # the harness's own limit (it takes its torchrun and ranks down) comes first; this
        # process's timeout is the backstop for a harness that hangs outside torchrun
        argv = [python, "-m", "workers.calibrate", "--out", str(out), "--timeout", str(max(5.0, limit - 60))]
        argv += ["--quick"] if quick else []
        try:
            proc = subprocess.run(argv, cwd=cwd, text=True, capture_output=True, timeout=limit)
        except subprocess.TimeoutExpired:
            raise HarnessFailed(f"the calibration harness did not finish in {limit:.0f} s") from None
        if proc.returncode != 0 or not out.exists():
            raise HarnessFailed(f"the calibration harness exited {proc.returncode}: {proc.stderr[-2000:]}")
        doc = json.loads(out.read_text())
        try:
            summary = json.loads(proc.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            summary = {}
    try:
        parse_measurements(doc)
    except MeasurementsError as e:
        raise HarnessFailed(f"the calibration harness wrote an invalid document: {e}") from None
    return doc, summary
