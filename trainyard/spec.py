"""The JobSpec contract (docs/architecture.md, "Contracts"): the one typed description of a job.

Both planes import this module: the control plane parses every submitted spec with
`parse_job_spec` (HTTP 400 on error) and stores it with every default filled in; the runtime
validates the `spec` part of its launch config with the same `JobSpec` model
(workers/runtime/config.py). Each field is declared, defaulted and bounded once, here, with a
description; every rule that relates two or more fields is one `Rule` in `RULES`.

`parse_job_spec` returns a validated spec or raises SpecError whose `.errors` maps dotted field
paths ("model.hidden") to messages, which the API returns as HTTP 400 verbatim.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError,
                      field_validator, model_validator)

from .mesh import param_count
from .rules import Rule as Rule, SpecError as SpecError  # re-exported: the spec's public names
from .spec_parallel import MAX_STEPS, CommSpec, ParallelSpec
from .spec_resources import MAX_LABELS as MAX_LABELS, ResourcesSpec
from .tags import MAX_NOTE_CHARS, MAX_TAGS, Note, Tags
from .textdoc import DocError, load_text
from .usercode import CodeSpec, Config, EntrypointSpec, EnvVars, PythonPath

# Upper bounds that catch typos (hidden: 1280000) before they become an OOM on a node.
MAX_PARAMS = 20_000_000_000
BYTE_VOCAB = 256  # the demo corpus is byte-level text: every token id is in [0, 256)
UINT16_IDS = 65536  # a data.kind tokens file holds uint16 ids


# ---- cross-field rules (the table comes first: the sections' defaults are validated as the
# classes are defined) -------------------------------------------------------------------------
def _per_replica_batch(s: JobSpec) -> int:
    return s.train.global_batch // max(1, s.dp)


def _dp_at(s: JobSpec, nodes: int) -> int:
    return nodes * s.resources.procs_per_node // (s.plan.tp * s.plan.pp)


def _elastic_world_break(s: JobSpec) -> int | None:
    # The first node count in the elastic range whose processes do not split into tp x pp groups.
    return next((k for k in s.resources.node_counts
                 if (k * s.resources.procs_per_node) % (s.plan.tp * s.plan.pp)), None)


def _elastic_batch_break(s: JobSpec) -> int | None:
    # The first node count in the elastic range at which the global batch does not split evenly.
    return next((k for k in s.resources.node_counts
                 if s.train.global_batch % max(1, _dp_at(s, k) * s.train.grad_accum)), None)


def _builtin(s: JobSpec) -> bool:
    # A built-in job (the "spec" rules below the first ones guarantee model and data are set).
    return s.model is not None and s.data is not None


# What run.prepare (trainyard/sdk/prepare.py) applies to an entrypoint job's own model today.
_PREPARE_DP = ("run.prepare applies DDP with comm.compression, comm.sync, parallel.recompute and "
               "parallel.shard_optimizer, parallel.fsdp, or parallel.tp (tp or dp x tp) to your model; "
               "train.grad_accum through run.micro_batches, train.balance through run.loader, and plans it under "
               "parallel auto; pp for your own model is not supported yet")


# Every cross-field rule of the JobSpec, in evaluation order (which decides the order of the
# messages). The runtime and the form never repeat one: they dispatch on values these allow.
RULES: tuple[Rule, ...] = (
    Rule("model", "model", lambda m: m.kind == "gpt" and m.hidden % m.heads,
         lambda m: f"hidden ({m.hidden}) must be divisible by heads ({m.heads})"),
    Rule("model", "model", lambda m: m.param_count() > MAX_PARAMS,
         lambda m: f"model has about {m.param_count():.3g} parameters; the limit is {MAX_PARAMS:.3g}"),
    Rule("data", "data", lambda d: d.kind == "tokens" and not d.path,
         lambda d: "data.kind 'tokens' needs data.path (a uint16 .bin file under the data root)"),
    Rule("data", "data", lambda d: d.kind != "tokens" and d.path,
         lambda d: f"data.path is only used with kind 'tokens', not '{d.kind}'"),
    # A job runs either a built-in model (model, data) or its own code (entrypoint), never both.
    Rule("spec", "model", lambda s: s.user_code and s.model is not None,
         lambda s: "model and entrypoint exclude each other: a job runs either a built-in model or "
                   "your own code (entrypoint); remove model"),
    Rule("spec", "data", lambda s: s.user_code and s.data is not None,
         lambda s: "data belongs to the built-in models; an entrypoint job loads its own data: remove data"),
    Rule("spec", "entrypoint", lambda s: s.user_code and (s.entrypoint.script is None) == (s.entrypoint.module is None),
         lambda s: "entrypoint needs exactly one of script (a Python file) or module (run as python -m)"),
    Rule("spec", "entrypoint.script",
         lambda s: s.user_code and s.code is not None and (s.entrypoint.script or "").startswith("/"),
         lambda s: "with code.bundle, script is a path inside the bundle (like train.py), not an absolute path"),
    Rule("spec", "entrypoint.script",
         lambda s: s.user_code and s.code is None and s.entrypoint.script is not None
         and not s.entrypoint.script.startswith("/"),
         lambda s: "without code.bundle, script must be an absolute path on the nodes (or upload the code "
                   "and set code.bundle, or use module, looked up on the node's PYTHONPATH)"),
    Rule("spec", "parallel.dp", lambda s: s.dp * s.plan.tp * s.plan.pp != s.resources.world_size,
         lambda s: f"dp x tp x pp = {s.dp} x {s.plan.tp} x {s.plan.pp} must equal the number of "
                   f"processes, resources.nodes x procs_per_node = {s.resources.world_size}"),
    Rule("spec", "train.global_batch", lambda s: (_builtin(s) or s.train.grad_accum > 1)
         and s.train.global_batch % (s.dp * s.train.grad_accum),
         lambda s: f"global_batch ({s.train.global_batch}) must be divisible "
                   f"by dp x grad_accum = {s.dp * s.train.grad_accum}"),
    # Elastic: dp follows the node count, and the global batch must split at every count.
    Rule("spec", "parallel.dp", lambda s: s.resources.elastic and s.plan.dp is not None,
         lambda s: "an elastic job's dp follows its node count: leave parallel.dp unset (it is "
                   "nodes x procs_per_node / (tp x pp) on whatever count the job runs)"),
    Rule("spec", "parallel", lambda s: s.resources.elastic and _elastic_world_break(s) is not None,
         lambda s: f"an elastic job runs tp x pp = {s.plan.tp * s.plan.pp} on every node count: on "
                   f"{_elastic_world_break(s)} nodes its {_elastic_world_break(s) * s.resources.procs_per_node} "
                   f"processes do not split into groups of that size; raise nodes.min or procs_per_node"),
    Rule("spec", "train.global_batch", lambda s: s.resources.elastic and _elastic_world_break(s) is None
         and _elastic_batch_break(s) is not None,
         lambda s: f"an elastic job keeps its global batch on every node count: global_batch "
                   f"({s.train.global_batch}) must be divisible by dp x grad_accum at each; on "
                   f"{_elastic_batch_break(s)} nodes that is {_dp_at(s, _elastic_batch_break(s)) * s.train.grad_accum}"),
    Rule("spec", "model.vocab", lambda s: _builtin(s) and s.data.kind == "demo" and s.model.vocab < BYTE_VOCAB,
         lambda s: f"the demo corpus uses byte tokens: vocab must be at least {BYTE_VOCAB}"),
    Rule("spec", "train.warmup_steps", lambda s: s.train.warmup_steps > s.train.steps,
         lambda s: "warmup_steps must not exceed steps"),
    # User code: what the control plane sets up for it, and what only the built-in trainer does.
    Rule("submit", "resources.gpu_memory_gb", lambda s: s.resources.device != "cuda" and s.resources.gpu_memory_gb,
         lambda s: "gpu_memory_gb applies to a cuda job: set resources.device to cuda, or drop it"),
    Rule("submit", "code", lambda s: s.code is not None and not s.user_code,
         lambda s: "code.bundle holds the code an entrypoint runs: add entrypoint (script or module)"),
    *(Rule("submit", f, lambda s, f=f: not s.user_code and getattr(s, f) not in (None, {}),
           lambda s, f=f: f"{f} applies to an entrypoint job (your own code); the built-in trainer "
                          f"does not use it") for f in ("config", "env", "python")),
    Rule("submit", "parallel", lambda s: s.user_code and s.plan.pp > 1,
         lambda s: f"an entrypoint job has no pipeline stages (pp 1): {_PREPARE_DP}; "
                   f"a script that builds its own pipeline does so inside its world"),
    Rule("submit", "parallel.shard_optimizer", lambda s: s.user_code and s.plan.tp > 1 and s.plan.shard_optimizer,
         lambda s: "run.prepare's ZeRO-1 shards whole parameters over dp, not tensor-parallel shards: "
                   "use shard_optimizer false with tp, or fsdp with tp 1"),
    Rule("submit", "parallel.tp", lambda s: _builtin(s) and s.model.kind == "gpt" and s.model.heads % s.plan.tp,
         lambda s: f"tp ({s.plan.tp}) must divide model.heads ({s.model.heads}): each tensor-parallel "
                   f"rank computes whole attention heads"),
    Rule("submit", "parallel.tp", lambda s: s.resources.nodes > 1 and s.resources.procs_per_node % s.plan.tp,
         lambda s: f"tp ({s.plan.tp}) must divide resources.procs_per_node ({s.resources.procs_per_node}) "
                   f"on {s.resources.nodes} nodes: a tensor-parallel group's consecutive ranks must sit on "
                   f"one node (its per-layer collectives cross no node link, and its replicated "
                   f"parameters get bitwise-equal gradients)"),
    Rule("submit", "parallel.tp", lambda s: _builtin(s) and s.model.kind == "mlp" and s.plan.tp > 1,
         lambda s: "tensor parallelism splits attention heads and MLP columns of the GPT; "
                   "model.kind mlp has no heads: use tp 1"),
    Rule("submit", "parallel.pp", lambda s: _builtin(s) and s.plan.pp > s.model.layers,
         lambda s: f"pp ({s.plan.pp}) must not exceed model.layers ({s.model.layers}): every pipeline "
                   f"stage needs at least one layer"),
    Rule("submit", "parallel.pp", lambda s: _builtin(s) and s.plan.pp > 1 and s.model.kind != "gpt",
         lambda s: "pipeline stages split the GPT's blocks: model.kind must be gpt"),
    Rule("submit", "parallel.pp", lambda s: s.plan.pp > 1 and s.plan.tp > 1,
         lambda s: "pipeline and tensor parallelism together (tp x pp) are not supported; "
                   "use dp x pp or dp x tp"),
    Rule("submit", "parallel.microbatches",
         lambda s: s.plan.pp > 1 and _per_replica_batch(s) % s.plan.microbatches,
         lambda s: f"each data-parallel replica's batch (global_batch / dp = {_per_replica_batch(s)}) "
                   f"must be divisible by microbatches ({s.plan.microbatches})"),
    Rule("submit", "parallel.microbatches",
         lambda s: s.plan.pp > 1 and s.plan.schedule == "1f1b" and s.plan.microbatches < s.plan.pp,
         lambda s: f"the 1f1b schedule needs at least as many micro-batches as "
                   f"stages ({s.plan.pp}), got {s.plan.microbatches}"),
    Rule("submit", "train.grad_accum", lambda s: s.plan.pp > 1 and s.train.grad_accum != 1,
         lambda s: "with pipeline parallelism the step is already split into "
                   "parallel.microbatches; use that instead of grad_accum"),
    Rule("submit", "parallel.fsdp", lambda s: s.plan.pp > 1 and s.plan.fsdp,
         lambda s: "FSDP together with pipeline parallelism is not supported; "
                   "use dp x pp with fsdp false"),
    Rule("submit", "parallel.fsdp", lambda s: s.plan.fsdp and s.plan.tp > 1,
         lambda s: "FSDP together with tensor parallelism is not supported; use dp x tp "
                   "with fsdp false, or fsdp with tp 1"),
    Rule("submit", "parallel.shard_optimizer", lambda s: s.plan.shard_optimizer and s.plan.fsdp,
         lambda s: "fsdp already shards the optimizer state (with the parameters and gradients) over dp: "
                   "use shard_optimizer false with fsdp true"),
    Rule("submit", "parallel.shard_optimizer", lambda s: s.plan.shard_optimizer and s.dp < 2,
         lambda s: f"shard_optimizer splits the optimizer state over the data-parallel ranks; the job has "
                   f"dp {s.dp}: use shard_optimizer false (or dp >= 2)"),
    Rule("submit", "parallel.shard_optimizer", lambda s: s.plan.shard_optimizer and s.comm.sync != "allreduce",
         lambda s: f"with shard_optimizer each rank updates only its share of the parameters from the "
                   f"averaged gradients, but comm.sync {s.comm.sync} averages no gradients: use allreduce"),
    Rule("submit", "comm.compression", lambda s: not s.plain_ddp and s.comm.compression != "none",
         lambda s: "gradient compression is a DDP comm hook: it needs plain data "
                   "parallelism (tp 1, pp 1, fsdp false)"),
    Rule("submit", "comm.sync", lambda s: not s.plain_ddp and s.comm.sync != "allreduce",
         lambda s: f"{s.comm.sync} averages whole model replicas: it needs plain data parallelism "
                   f"(tp 1, pp 1, fsdp false)"),
    Rule("submit", "comm.sync", lambda s: s.comm.sync != "allreduce" and s.dp < 2,
         lambda s: f"{s.comm.sync} averages models across ranks: it needs at least 2 data-parallel "
                   f"ranks, the job has {s.dp}"),
    Rule("submit", "comm.sync", lambda s: s.comm.sync != "allreduce" and s.resources.elastic
         and _dp_at(s, s.resources.min_nodes) < 2,
         lambda s: f"{s.comm.sync} averages models across ranks: on its least nodes ({s.resources.min_nodes}) "
                   f"this elastic job has {_dp_at(s, s.resources.min_nodes)} data-parallel rank(s), it needs 2"),
    Rule("submit", "comm.compression", lambda s: s.comm.sync != "allreduce" and s.comm.compression != "none",
         lambda s: f"compression applies to every-step gradient all-reduce; with "
                   f"comm.sync {s.comm.sync} use compression none"),
    Rule("submit", "comm.sync", lambda s: s.comm.sync == "hierarchical" and (
        (s.resources.min_nodes or s.resources.nodes) < 2 or s.resources.procs_per_node < 2),
         lambda s: "hierarchical averaging needs several nodes with several ranks each "
                   f"(resources {s.resources.nodes} x {s.resources.procs_per_node}); use local_sgd"),
    Rule("submit", "comm.periods.global",
         lambda s: s.comm.sync == "hierarchical" and (s.comm.periods.global_ <= s.comm.periods.node
                                                      or s.comm.periods.global_ % s.comm.periods.node),
         lambda s: f"the global period ({s.comm.periods.global_}) must be a multiple "
                   f"of the node period ({s.comm.periods.node}) and larger than it"),
    Rule("submit", "comm.ratio", lambda s: s.comm.ratio == "auto" and s.comm.compression != "topk",
         lambda s: "ratio auto chooses the top-k ratio: it needs compression topk"),
    Rule("submit", "train.balance", lambda s: s.train.balance == "auto" and not s.plain_ddp,
         lambda s: "balancing splits the batch between data-parallel replicas: it "
                   "needs plain data parallelism (tp 1, pp 1, fsdp false)"),
    Rule("submit", "train.balance", lambda s: s.train.balance == "auto" and s.comm.sync != "allreduce",
         lambda s: "balancing weights the every-step gradient all-reduce: it needs "
                   "comm.sync allreduce"),
    Rule("submit", "model.vocab", lambda s: _builtin(s) and s.data.kind == "tokens" and s.model.vocab > UINT16_IDS,
         lambda s: f"data.kind tokens stores uint16 ids: vocab must be at most {UINT16_IDS}, "
                   f"got {s.model.vocab}"),
)


def broken_rules(x: Any, on: str) -> list[tuple[str, str]]:
    """(field, message) of every rule in RULES evaluated `on` x that x breaks, in table order."""
    return [(r.field, r.message(x)) for r in RULES if r.on == on and r.broken(x)]


def _raise_first_broken(x: Any, on: str) -> None:
    # Evaluate in table order and stop at the first: the same single message as before the table.
    for r in RULES:
        if r.on == on and r.broken(x):
            raise _FieldError(r.field, r.message(x))


class _FieldError(ValueError):
    """Raised inside a model validator to attach the message to a specific field path."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=True)


class ModelSpec(_Strict):
    """The network: one of the two built-in families (workers/runtime/model.py)."""

    kind: Literal["gpt", "mlp"] = Field("gpt", description="gpt: a causal transformer; mlp: a residual MLP "
                                                           "(no attention, no heads)")
    layers: int = Field(4, ge=1, le=256, description="transformer blocks (gpt) or residual blocks (mlp)")
    hidden: int = Field(128, ge=8, le=65536, description="width of every layer; gpt: divisible by heads")
    heads: int = Field(4, ge=1, le=512, description="gpt: attention heads per block; ignored by mlp")
    seq_len: int = Field(128, ge=2, le=131072, description="tokens per training window (the context length)")
    vocab: int = Field(256, ge=2, le=1_000_000, description="token ids are in [0, vocab); data.kind demo "
                                                            "needs at least 256 (byte tokens)")

    @model_validator(mode="after")
    def _check(self) -> "ModelSpec":
        _raise_first_broken(self, "model")
        return self

    def param_count(self) -> int:
        """Parameters of the model the runtime builds from this section (trainyard/mesh.py)."""
        return param_count(self.kind, layers=self.layers, hidden=self.hidden, seq_len=self.seq_len,
                           vocab=self.vocab)


class DataSpec(_Strict):
    """Where the training tokens come from."""

    kind: Literal["demo", "synthetic", "tokens"] = Field(
        "demo", description="demo: the shipped byte-level text corpus; synthetic: seeded random tokens; "
                            "tokens: a uint16 .bin file under the data root")
    path: str | None = Field(None, description="tokens only: the .bin file, relative to the data root")

    @model_validator(mode="after")
    def _check(self) -> "DataSpec":
        _raise_first_broken(self, "data")
        return self


class TrainSpec(_Strict):
    """The optimisation loop: how long, how big a step, and the learning-rate schedule."""

    steps: int = Field(200, ge=1, le=MAX_STEPS, description="optimizer steps in the whole run")
    global_batch: int = Field(32, ge=1, le=1_048_576,
                              description="samples per optimizer step over all ranks; divisible by "
                                          "dp x grad_accum")
    lr: float = Field(1.0e-3, gt=0, le=10, description="peak learning rate (AdamW)")
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS, description="linear warm-up from 0 to lr; at most steps")
    lr_schedule: Literal["constant", "cosine"] = Field("constant",
                                                       description="after warm-up: constant, or cosine decay to 0")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="seeds the model's initialisation and the data order")
    grad_accum: int = Field(1, ge=1, le=4096,
                            description="micro-steps per optimizer step; gradients are synchronised only "
                                        "on the last")
    balance: Literal["none", "auto"] = Field("none", description="auto: split each step's batch between "
                                                                 "data-parallel ranks by their measured speed")


class CheckpointSpec(_Strict):
    """When the runtime saves, and how many complete checkpoints the control plane keeps."""

    every_steps: int = Field(50, ge=1, le=MAX_STEPS, description="save after every this many steps (and after the last)")
    async_: bool = Field(True, alias="async", description="save in the background while training goes on")
    keep: int = Field(3, ge=1, le=1000, description="complete checkpoints kept; older ones are deleted")
    pinned_host_fraction: float = Field(
        0.25, ge=0, le=0.9, description="async saves on CUDA: the share of a node's host RAM its ranks may keep "
                                        "page-locked for the copy of the state they write (split evenly between "
                                        "the node's ranks; beyond it the copy is pageable, slower; 0: never pinned)")


def _parallel_tag(v: Any) -> str:
    return "auto" if isinstance(v, str) else "object"


class JobSpec(_Strict):
    """A whole job as submitted: name, what runs (a built-in model and data, or an entrypoint with its
    code, config, env and interpreter), training, resources, parallelism, communication,
    checkpointing and scheduling. `to_json()` is the stored form, every default filled in."""

    name: str = Field(min_length=1, max_length=200, description="shown in the dashboard; no control characters")
    model: ModelSpec | None = Field(None, description="the built-in network; defaulted for a built-in job, "
                                                      "null for an entrypoint job")
    data: DataSpec | None = Field(None, description="the built-in trainer's tokens; defaulted for a built-in "
                                                    "job, null for an entrypoint job")
    code: CodeSpec | None = Field(None, description="the entrypoint's code bundle; null: the entrypoint is "
                                                    "looked up on the nodes")
    entrypoint: EntrypointSpec | None = Field(None, description="your own training code (instead of model "
                                                                "and data): a script or module with its args")
    config: Config = Field(default_factory=dict, description="free-form JSON object handed to the entrypoint "
                                                             "as run.config (at most 64 KiB as JSON)")
    env: EnvVars = Field(default_factory=dict, description="environment variables for every rank of an "
                                                           "entrypoint job (names [A-Z_][A-Z0-9_]*; "
                                                           "Trainyard's and torchrun's own refused)")
    python: PythonPath = Field(None, description="absolute path of the interpreter on the nodes; null: "
                                                 "the agent's own")
    train: TrainSpec = Field(TrainSpec(), description="the optimisation loop")
    resources: ResourcesSpec = Field(ResourcesSpec(), description="nodes, processes and device")
    parallel: Annotated[
        Union[Annotated[Literal["auto"], Tag("auto")], Annotated[ParallelSpec, Tag("object")]],
        Discriminator(_parallel_tag),
    ] = Field(ParallelSpec(), description="the parallel plan; auto: data parallel over every process")
    comm: CommSpec = Field(CommSpec(), description="gradient / model synchronisation")
    checkpoint: CheckpointSpec = Field(CheckpointSpec(), description="saving and retention")
    priority: Literal["low", "normal", "high"] = Field("normal", description="queue order among runnable jobs")
    max_restarts: int = Field(3, ge=0, le=100, description="attempts after the first before the job fails")
    adapt: Literal["advise", "auto"] = Field("advise", description="advise: profiles and OOMs suggest plan "
                                            "changes; auto: the control plane applies them itself (re-plan on "
                                            "OOM, keep a bottleneck fix only if the step got faster)")
    adapt_max: int = Field(3, ge=0, le=100, description="adapt auto: the most automatic plan changes per job")
    hang_timeout_s: Union[Literal["auto"], Annotated[float, Field(gt=0, le=7 * 86400)]] = Field(
        "auto", description="seconds without a step before an attempt counts as hung; auto: from its "
                            "own step times")
    tags: Tags = Field(default_factory=list, description=f"at most {MAX_TAGS} short labels for finding the "
                            "job in the list (`/jobs/?tag=x`, `trainyard ls --tag x`): a-z, 0-9, '.', '_', '-', "
                            "1-40 characters each; editable after submit by the owner and team")
    note: Note = Field("", description=f"free text about the job (at most {MAX_NOTE_CHARS} characters); editable "
                                      "after submit like tags")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if any(ord(c) < 32 for c in v):
            raise ValueError("name must not contain control characters")
        return v

    @model_validator(mode="before")
    @classmethod
    def _builtin_defaults(cls, data: Any) -> Any:
        # Without an entrypoint the job runs the built-in trainer: model and data default to the demo.
        if isinstance(data, dict) and data.get("entrypoint") is None:
            data = {**data, **{k: {} for k in ("model", "data") if data.get(k) is None}}
        return data

    @model_validator(mode="after")
    def _consistency(self) -> "JobSpec":
        _raise_first_broken(self, "spec")
        return self

    @property
    def user_code(self) -> bool:
        """An entrypoint job: the launcher runs the user's script or module instead of the built-in trainer."""
        return self.entrypoint is not None

    @property
    def plan(self) -> ParallelSpec:
        """The parallel plan; "auto" reads as the default plan (dp over every process)."""
        return self.parallel if isinstance(self.parallel, ParallelSpec) else ParallelSpec()

    @property
    def dp(self) -> int:
        """Data-parallel replicas: parallel.dp, else world size / (tp x pp)."""
        p = self.plan
        return p.dp if p.dp is not None else self.resources.world_size // (p.tp * p.pp)

    @property
    def plain_ddp(self) -> bool:
        """Plain data parallelism (tp 1, pp 1, fsdp false): what comm hooks and model averaging need."""
        p = self.plan
        return p.tp == 1 and p.pp == 1 and not p.fsdp

    def at_nodes(self, nodes: int) -> "JobSpec":
        """This spec on `nodes` nodes (an elastic job's attempt world), min_nodes kept at most it;
        dp follows. SpecError when the count is outside the range or a rule refuses it."""
        r = self.resources
        if not (r.min_nodes or r.nodes) <= nodes <= r.nodes:
            raise SpecError({"resources.nodes": [f"{nodes} nodes is outside [{r.min_nodes or r.nodes}, {r.nodes}]"]})
        data = self.to_json()
        return parse_job_spec({**data, "resources": {**data["resources"], "nodes": nodes,
                                                     "min_nodes": min(r.min_nodes or nodes, nodes)}})

    def to_json(self) -> dict:
        """Full spec with every default filled in, in the user-facing key names."""
        return self.model_dump(mode="json", by_alias=True)

    def with_parallel(self, parallel: dict, grad_accum: int) -> "JobSpec":
        """A new JobSpec that runs `parallel` (a `parallel` section) with `grad_accum`, checked as a
        submitted one is (SpecError when a rule refuses it): the planner's choice, or a candidate."""
        data = self.to_json()
        return parse_job_spec({**data, "parallel": parallel, "train": {**data["train"], "grad_accum": grad_accum}})


def unsupported_options(spec: JobSpec) -> dict[str, list[str]]:
    """The "submit" rules `spec` breaks, as SpecError.errors: field path -> messages."""
    errs: dict[str, list[str]] = {}
    for field, message in broken_rules(spec, "submit"):
        errs.setdefault(field, []).append(message)
    return errs


def _loc(loc: tuple) -> str:
    # Drop pydantic's union-branch tags so paths read like the spec ("parallel.dp").
    parts = [str(p) for p in loc if p not in ("object", "auto") and not str(p).startswith(("literal[", "function-"))]
    parts = ["global" if p == "global_" else p for p in parts]
    return ".".join(parts) or "spec"


def validate_job_spec(data: Any, *, unknown_keys: Literal["forbid", "ignore"] = "forbid") -> JobSpec:
    """`data` as a JobSpec, checked by the model alone (types, bounds and the "model", "data" and
    "spec" rules), or SpecError naming each bad field. The runtime validates its launch config
    with this (workers/runtime/config.py), ignoring keys it does not know (a newer control plane
    may send them); `parse_job_spec` adds the submit-time checks."""
    if not isinstance(data, dict):
        raise SpecError({"spec": ["a job spec must be a JSON/YAML object (mapping)"]})
    try:
        return JobSpec.model_validate(data, extra=unknown_keys)
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


def parse_job_spec(data: Any, *, data_root: Path | None = None) -> JobSpec:
    """The validated JobSpec for `data` (a parsed JSON/YAML mapping), or SpecError naming each
    bad field: the model's own checks, then every "submit" rule, then (with `data_root`) whether
    data.path names a usable token file there."""
    spec = validate_job_spec(data)
    errors = unsupported_options(spec)
    if spec.data is not None and spec.data.kind == "tokens" and data_root is not None:
        problem = data_path_problem(spec.data.path or "", data_root)
        if problem:
            errors.setdefault("data.path", []).append(problem)
    if errors:
        raise SpecError(errors)
    return spec


def data_path_problem(path: str, data_root: Path) -> str | None:
    """Why `path` is not a usable tokens file under `data_root`, or None when it is."""
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
    """JSON or YAML text from a form or CLI, bounded before and while parsing (trainyard/textdoc.py:
    size, depth, no YAML anchors or aliases, no objects); SpecError at "spec" otherwise."""
    text = text.strip()
    if not text:
        raise SpecError({"spec": ["the spec is empty"]})
    try:
        return load_text(text)
    except DocError as exc:
        raise SpecError({"spec": [str(exc)]}) from None
