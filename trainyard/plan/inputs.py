"""The planner's input (DESIGN.md "Planner I/O"), validated: `parse_plan_request(data)` returns a
`PlanRequest` or raises `PlanInputError` naming each bad field ("model.heads" -> messages).

Units: memory in GB (1e9 bytes), peak in TFLOP/s, bandwidths in GB/s one way (`intra_node_gbs`
per device to its peers inside a node, `inter_node_gbs` per node across nodes). Bounds make
absurd input a field error rather than an hour of search or an overflow.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class PlanInputError(ValueError):
    """Bad planner input: `errors` maps a field path ("cluster.nodes", "fix.tp") to messages."""

    def __init__(self, errors: dict[str, list[str]]):
        super().__init__("; ".join(f"{k}: {' '.join(v)}" for k, v in errors.items()))
        self.errors = errors


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ModelShape(_Strict):
    """A GPT's shape, or only its parameter count (`params`: then only dp / fsdp / ZeRO-1 plans
    are searched, and activations are not counted)."""

    layers: int | None = Field(None, ge=1, le=10_000, description="transformer blocks")
    hidden: int | None = Field(None, ge=1, le=1_000_000, description="model width")
    heads: int | None = Field(None, ge=1, le=100_000, description="attention heads; must divide hidden")
    seq_len: int = Field(2048, ge=1, le=10_000_000, description="tokens per sequence")
    vocab: int = Field(51200, ge=1, le=100_000_000, description="vocabulary size")
    params: int | None = Field(None, ge=1, le=10**15, description="parameters, for a model given only by size")
    attention: Literal["fused", "materialized"] = Field(
        "fused", description="fused (flash / SDPA, our GPT): the a x s x s score matrices are not kept for "
                             "backward; materialized: they are (Korthikanti's 5*a*s/h term)")

    @property
    def sized_only(self) -> bool:
        return self.layers is None


class Device(_Strict):
    name: str = Field(min_length=1, max_length=200, description='device type, e.g. "A100-80GB" or "cpu"')
    memory_gb: float = Field(gt=0, le=100_000, description="memory per device, GB (1e9 bytes)")
    peak_tflops: float = Field(gt=0, le=1_000_000, description="peak dense TFLOP/s at the training precision")


class Cluster(_Strict):
    nodes: int = Field(ge=1, le=100_000)
    devices_per_node: int = Field(ge=1, le=1024)
    device: Device
    intra_node_gbs: float = Field(gt=0, le=1_000_000, description="one device's one-way GB/s to its node peers")
    inter_node_gbs: float = Field(gt=0, le=1_000_000, description="one node's one-way network GB/s")

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node


class Fix(_Strict):
    """Values every returned plan must have (the search is restricted to them)."""

    dp: int | None = Field(None, ge=1)
    tp: int | None = Field(None, ge=1)
    pp: int | None = Field(None, ge=1)
    micro_batch: int | None = Field(None, ge=1)
    fsdp: bool | None = None
    shard_optimizer: bool | None = None
    recompute: Literal["none", "full"] | None = None
    schedule: Literal["gpipe", "1f1b"] | None = None


class PlanRequest(_Strict):
    model: ModelShape
    cluster: Cluster
    global_batch: int = Field(ge=1, le=100_000_000, description="sequences per optimizer step")
    precision: Literal["bf16", "fp32"] | None = Field(None, description="default: fp32 on cpu, bf16 elsewhere")
    fix: Fix = Field(default_factory=Fix)

    @property
    def dtype(self) -> str:
        if self.precision:
            return self.precision
        return "fp32" if self.cluster.device.name.strip().lower() == "cpu" else "bf16"

    @model_validator(mode="after")
    def _consistent(self) -> "PlanRequest":
        errors = contradictions(self)
        if errors:
            raise _Contradictions(errors)
        return self


class _Contradictions(ValueError):
    def __init__(self, errors: dict[str, list[str]]):
        super().__init__("contradictions")
        self.errors = errors


def _model_errors(m: ModelShape) -> dict[str, list[str]]:
    errs: dict[str, list[str]] = {}
    shape = {"layers": m.layers, "hidden": m.hidden, "heads": m.heads}
    given = [k for k, v in shape.items() if v is not None]
    if m.params is not None and given:
        errs["model"] = ["give either {layers, hidden, heads, seq_len, vocab} or {params}, not both"]
    elif m.params is None and len(given) < 3:
        for k in shape:
            if shape[k] is None:
                errs[f"model.{k}"] = ["required (or give the model as {params})"]
    elif m.params is None and m.hidden % m.heads:
        errs["model.heads"] = [f"{m.heads} heads do not divide hidden {m.hidden}"]
    return errs


def contradictions(req: PlanRequest) -> dict[str, list[str]]:
    """Field errors no single field shows: heads vs hidden, fix values vs each other, the model
    and the device count."""
    errs = _model_errors(req.model)
    f, m, devices = req.fix, req.model, req.cluster.devices
    add = lambda k, msg: errs.setdefault(k, []).append(msg)  # noqa: E731
    for k in ("dp", "tp", "pp"):
        v = getattr(f, k)
        if v is not None and devices % v:
            add(f"fix.{k}", f"{k}={v} does not divide the {devices} devices")
    if f.dp and f.tp and f.pp and f.dp * f.tp * f.pp != devices:
        add("fix", f"dp*tp*pp = {f.dp * f.tp * f.pp} but the cluster has {devices} devices")
    if m.sized_only and m.params is not None:
        for k in ("tp", "pp"):
            if (getattr(f, k) or 1) > 1:
                add(f"fix.{k}", "a model given only by {params} cannot be split: give its shape")
    elif not errs:
        if f.tp and m.heads % f.tp:
            add("fix.tp", f"tp={f.tp} does not divide the {m.heads} heads")
        if f.pp and f.pp > m.layers:
            add("fix.pp", f"pp={f.pp} is more stages than the {m.layers} layers")
    if f.dp and req.global_batch % f.dp:
        add("fix.dp", f"dp={f.dp} does not divide global_batch {req.global_batch}")
    if f.micro_batch and f.micro_batch > req.global_batch:
        add("fix.micro_batch", f"micro_batch {f.micro_batch} > global_batch {req.global_batch}")
    if f.fsdp and f.shard_optimizer:
        add("fix.shard_optimizer", "shard_optimizer (ZeRO-1) is for DDP; fsdp already shards the optimizer")
    if f.schedule and f.pp == 1:
        add("fix.schedule", "a pipeline schedule needs pp > 1")
    return errs


def _loc(loc: tuple) -> str:
    return ".".join(str(p) for p in loc if not str(p).startswith(("function-", "literal["))) or "request"


def parse_plan_request(data: Any) -> PlanRequest:
    """`data` (parsed JSON) as a PlanRequest, or PlanInputError with every bad field."""
    if not isinstance(data, dict):
        raise PlanInputError({"request": ["a plan request is a JSON object {model, cluster, global_batch, ...}"]})
    try:
        return PlanRequest.model_validate(data)
    except ValidationError as exc:
        errors: dict[str, list[str]] = {}
        for err in exc.errors(include_url=False):
            found = (err.get("ctx") or {}).get("error")
            if isinstance(found, _Contradictions):
                for k, v in found.errors.items():
                    errors.setdefault(k, []).extend(v)
                continue
            msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
            errors.setdefault(_loc(err["loc"]), []).append(msg)
        raise PlanInputError(errors) from None
