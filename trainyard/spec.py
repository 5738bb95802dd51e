"""The JobSpec contract (docs/architecture.md, "Contracts"): pydantic models with defaults and clear errors.

`parse_job_spec` returns a validated spec or raises SpecError whose `.errors` maps dotted field
paths ("model.hidden") to messages, which the API returns as HTTP 400 verbatim.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError,
                      field_validator, model_validator)

from .mesh import param_count

# Upper bounds that catch typos (hidden: 1280000) before they become an OOM on a node.
MAX_PARAMS = 20_000_000_000
MAX_STEPS = 10_000_000


class SpecError(Exception):
    def __init__(self, errors: dict[str, list[str]]):
        super().__init__("; ".join(f"{k}: {' '.join(v)}" for k, v in errors.items()))
        self.errors = errors


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=True)


class ModelSpec(_Strict):
    kind: Literal["gpt", "mlp"] = "gpt"
    layers: int = Field(4, ge=1, le=256)
    hidden: int = Field(128, ge=8, le=65536)
    heads: int = Field(4, ge=1, le=512)
    seq_len: int = Field(128, ge=2, le=131072)
    vocab: int = Field(256, ge=2, le=1_000_000)

    @model_validator(mode="after")
    def _check(self) -> "ModelSpec":
        if self.kind == "gpt" and self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.param_count() > MAX_PARAMS:
            raise ValueError(f"model has about {self.param_count():.3g} parameters; the limit is {MAX_PARAMS:.3g}")
        return self

    def param_count(self) -> int:
        """Parameters of the model the runtime builds from this section (trainyard/mesh.py)."""
        return param_count(self.kind, layers=self.layers, hidden=self.hidden, seq_len=self.seq_len,
                           vocab=self.vocab)


class DataSpec(_Strict):
    kind: Literal["demo", "synthetic", "tokens"] = "demo"
    path: str | None = None

    @model_validator(mode="after")
    def _check(self) -> "DataSpec":
        if self.kind == "tokens" and not self.path:
            raise ValueError("data.kind 'tokens' needs data.path (a uint16 .bin file under the data root)")
        if self.kind != "tokens" and self.path:
            raise ValueError(f"data.path is only used with kind 'tokens', not '{self.kind}'")
        return self


class TrainSpec(_Strict):
    steps: int = Field(200, ge=1, le=MAX_STEPS)
    global_batch: int = Field(32, ge=1, le=1_048_576)
    lr: float = Field(1.0e-3, gt=0, le=10)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "cosine"] = "constant"
    seed: int = Field(0, ge=0, le=2**31 - 1)
    grad_accum: int = Field(1, ge=1, le=4096)
    balance: Literal["none", "auto"] = "none"


class ResourcesSpec(_Strict):
    nodes: int = Field(2, ge=1, le=4096)
    procs_per_node: int = Field(1, ge=1, le=64)
    device: Literal["cpu", "cuda"] = "cpu"

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


class ParallelSpec(_Strict):
    dp: int | None = Field(None, ge=1, description="defaults to world size / (tp * pp)")
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    fsdp: bool = False
    microbatches: int = Field(4, ge=1, le=1024)
    schedule: Literal["1f1b", "gpipe"] = "1f1b"


class Periods(_Strict):
    node: int = Field(2, ge=1)
    global_: int = Field(8, ge=1, alias="global")


class CommSpec(_Strict):
    compression: Literal["none", "fp16", "bf16", "powersgd", "topk"] = "none"
    ratio: Union[Literal["auto"], float] = Field(0.01, description="topk: fraction of each gradient bucket sent, (0, 1]")
    rank: int = Field(2, ge=1, le=1024, description="powersgd: matrix approximation rank")
    start_step: int = Field(10, ge=0, le=MAX_STEPS,
                            description="steps 1..start_step all-reduce dense gradients; compression starts after")
    sync: Literal["allreduce", "local_sgd", "hierarchical"] = "allreduce"
    period: int = Field(4, ge=1)
    periods: Periods = Periods()

    @field_validator("ratio", mode="before")
    @classmethod
    def _ratio(cls, v: Any) -> Any:
        # One clear message instead of one per union branch ("Input should be 'auto'", ...).
        if isinstance(v, str) and v.strip() == "auto":
            return "auto"
        try:
            ok = not isinstance(v, bool) and 0 < float(v) <= 1
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"ratio must be a fraction in (0, 1] (the share of each gradient bucket "
                             f"top-k sends) or 'auto', got {v!r}")
        return float(v)


class CheckpointSpec(_Strict):
    every_steps: int = Field(50, ge=1)
    async_: bool = Field(True, alias="async")
    keep: int = Field(3, ge=1, le=1000)


def _parallel_tag(v: Any) -> str:
    return "auto" if isinstance(v, str) else "object"


class JobSpec(_Strict):
    name: str = Field(min_length=1, max_length=200)
    model: ModelSpec = ModelSpec()
    data: DataSpec = DataSpec()
    train: TrainSpec = TrainSpec()
    resources: ResourcesSpec = ResourcesSpec()
    parallel: Annotated[
        Union[Annotated[Literal["auto"], Tag("auto")], Annotated[ParallelSpec, Tag("object")]],
        Discriminator(_parallel_tag),
    ] = ParallelSpec()
    comm: CommSpec = CommSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    priority: Literal["low", "normal", "high"] = "normal"
    max_restarts: int = Field(3, ge=0, le=100)
    hang_timeout_s: Union[Literal["auto"], Annotated[float, Field(gt=0, le=7 * 86400)]] = "auto"

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if any(ord(c) < 32 for c in v):
            raise ValueError("name must not contain control characters")
        return v

    @model_validator(mode="after")
    def _consistency(self) -> "JobSpec":
        world = self.resources.world_size
        if isinstance(self.parallel, ParallelSpec):
            p = self.parallel
            dp = p.dp if p.dp is not None else world // (p.tp * p.pp)
            if dp * p.tp * p.pp != world:
                raise _FieldError("parallel.dp", f"dp x tp x pp = {dp} x {p.tp} x {p.pp} must equal the number of "
                                                 f"processes, resources.nodes x procs_per_node = {world}")
        else:
            dp = world
        if self.train.global_batch % (dp * self.train.grad_accum):
            raise _FieldError("train.global_batch", f"global_batch ({self.train.global_batch}) must be divisible "
                                                    f"by dp x grad_accum = {dp * self.train.grad_accum}")
        if self.data.kind == "demo" and self.model.vocab < 256:
            raise _FieldError("model.vocab", "the demo corpus uses byte tokens: vocab must be at least 256")
        if self.train.warmup_steps > self.train.steps:
            raise _FieldError("train.warmup_steps", "warmup_steps must not exceed steps")
        return self

    @property
    def dp(self) -> int:
        if isinstance(self.parallel, ParallelSpec) and self.parallel.dp is not None:
            return self.parallel.dp
        if isinstance(self.parallel, ParallelSpec):
            return self.resources.world_size // (self.parallel.tp * self.parallel.pp)
        return self.resources.world_size

    def to_json(self) -> dict:
        """Full spec with every default filled in, in the user-facing key names."""
        return self.model_dump(mode="json", by_alias=True)


class _FieldError(ValueError):
    """Raised inside a model validator to attach the message to a specific field path."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


# Combinations that parse field by field but cannot run together: refused at submit, with the
# field to change and the reason, so a job never fails on them at run time.
def unsupported_options(spec: JobSpec) -> dict[str, list[str]]:
    errs: dict[str, list[str]] = {}

    def no(field: str, why: str) -> None:
        errs.setdefault(field, []).append(why)

    p = spec.parallel if isinstance(spec.parallel, ParallelSpec) else ParallelSpec()
    m, t, c, r = spec.model, spec.train, spec.comm, spec.resources
    plain_ddp = p.tp == 1 and p.pp == 1 and not p.fsdp
    if m.kind == "gpt" and m.heads % p.tp:
        no("parallel.tp", f"tp ({p.tp}) must divide model.heads ({m.heads}): each tensor-parallel rank "
                          f"computes whole attention heads")
    if m.kind == "mlp" and p.tp > 1:
        no("parallel.tp", "tensor parallelism splits attention heads and MLP columns of the GPT; "
                          "model.kind mlp has no heads: use tp 1")
    if p.pp > m.layers:
        no("parallel.pp", f"pp ({p.pp}) must not exceed model.layers ({m.layers}): every pipeline "
                          f"stage needs at least one layer")
    if p.pp > 1 and m.kind != "gpt":
        no("parallel.pp", "pipeline stages split the GPT's blocks: model.kind must be gpt")
    if p.pp > 1 and p.tp > 1:
        no("parallel.pp", "pipeline and tensor parallelism together (tp x pp) are not supported; "
                          "use dp x pp or dp x tp")
    if p.pp > 1:
        per_dp = t.global_batch // max(1, spec.dp)
        if per_dp % p.microbatches:
            no("parallel.microbatches", f"each data-parallel replica's batch (global_batch / dp = "
                                        f"{per_dp}) must be divisible by microbatches ({p.microbatches})")
        if p.schedule == "1f1b" and p.microbatches < p.pp:
            no("parallel.microbatches", f"the 1f1b schedule needs at least as many micro-batches as "
                                        f"stages ({p.pp}), got {p.microbatches}")
        if t.grad_accum != 1:
            no("train.grad_accum", "with pipeline parallelism the step is already split into "
                                   "parallel.microbatches; use that instead of grad_accum")
        if p.fsdp:
            no("parallel.fsdp", "FSDP together with pipeline parallelism is not supported; "
                                "use dp x pp with fsdp false")
    if p.fsdp and p.tp > 1:
        no("parallel.fsdp", "FSDP together with tensor parallelism is not supported; use dp x tp "
                            "with fsdp false, or fsdp with tp 1")
    if not plain_ddp and c.compression != "none":
        no("comm.compression", "gradient compression is a DDP comm hook: it needs plain data "
                               "parallelism (tp 1, pp 1, fsdp false)")
    if not plain_ddp and c.sync != "allreduce":
        no("comm.sync", f"{c.sync} averages whole model replicas: it needs plain data parallelism "
                        f"(tp 1, pp 1, fsdp false)")
    if c.sync != "allreduce" and spec.dp < 2:
        no("comm.sync", f"{c.sync} averages models across ranks: it needs at least 2 data-parallel "
                        f"ranks, the job has {spec.dp}")
    if c.sync != "allreduce" and c.compression != "none":
        no("comm.compression", f"compression applies to every-step gradient all-reduce; with "
                               f"comm.sync {c.sync} use compression none")
    if c.sync == "hierarchical":
        if r.nodes < 2 or r.procs_per_node < 2:
            no("comm.sync", "hierarchical averaging needs several nodes with several ranks each "
                            f"(resources {r.nodes} x {r.procs_per_node}); use local_sgd")
        if c.periods.global_ <= c.periods.node or c.periods.global_ % c.periods.node:
            no("comm.periods.global", f"the global period ({c.periods.global_}) must be a multiple "
                                      f"of the node period ({c.periods.node}) and larger than it")
    if c.ratio == "auto" and c.compression != "topk":
        no("comm.ratio", "ratio auto chooses the top-k ratio: it needs compression topk")
    if t.balance == "auto":
        if not plain_ddp:
            no("train.balance", "balancing splits the batch between data-parallel replicas: it "
                                "needs plain data parallelism (tp 1, pp 1, fsdp false)")
        if c.sync != "allreduce":
            no("train.balance", "balancing weights the every-step gradient all-reduce: it needs "
                                "comm.sync allreduce")
    return errs


def _loc(loc: tuple) -> str:
    # Drop pydantic's union-branch tags so paths read like the spec ("parallel.dp").
    parts = [str(p) for p in loc if p not in ("object", "auto") and not str(p).startswith(("literal[", "function-"))]
    parts = ["global" if p == "global_" else p for p in parts]
    return ".".join(parts) or "spec"


def parse_job_spec(data: Any, *, data_root: Path | None = None) -> JobSpec:
    if not isinstance(data, dict):
        raise SpecError({"spec": ["a job spec must be a JSON/YAML object (mapping)"]})
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as exc:
        errors: dict[str, list[str]] = {}
        for err in exc.errors(include_url=False):
            ctx_err = (err.get("ctx") or {}).get("error")
            if isinstance(ctx_err, _FieldError):
                errors.setdefault(ctx_err.field, []).append(str(ctx_err))
                continue
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = "unknown key"
            errors.setdefault(_loc(err["loc"]), []).append(msg)
        raise SpecError(errors) from None
    errors = unsupported_options(spec)
    if spec.data.kind == "tokens" and data_root is not None:
        problem = data_path_problem(spec.data.path or "", data_root)
        if problem:
            errors.setdefault("data.path", []).append(problem)
    if errors:
        raise SpecError(errors)
    return spec


def data_path_problem(path: str, data_root: Path) -> str | None:
    root = Path(data_root).resolve()
    p = Path(path)
    full = (p if p.is_absolute() else root / p).resolve()
    if full != root and root not in full.parents:
        return f"data.path must lie under the data root ({root})"
    if not full.is_file():
        return f"no such file under the data root: {path}"
    if full.stat().st_size % 2:
        return "a tokens file holds uint16 values, so its size must be even"
    return None


def parse_text(text: str) -> Any:
    """JSON or YAML text from a form or CLI; YAML safe_load only (no arbitrary objects)."""
    import json

    import yaml

    text = text.strip()
    if not text:
        raise SpecError({"spec": ["the spec is empty"]})
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecError({"spec": [f"neither valid JSON nor YAML: {exc}"]}) from None
