"""The parallel and communication sections of the JobSpec (trainyard/spec.py): `parallel` (the
mesh dp x tp x pp, FSDP, the pipeline's micro-batches and schedule, activation recomputation and
optimizer-state sharding) and `comm` (gradient compression, model averaging).

Each field is bounded on its own here; the rules relating them to each other and to the rest of
the spec (dp x tp x pp = world size, what each strategy cannot run) are in `spec.RULES`.
"""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .textdoc import echo

MAX_STEPS = 10_000_000  # train.steps and comm.start_step (a step number) are at most this
MAX_WORLD = 4096 * 64  # resources.nodes x procs_per_node at most: no mesh dimension exceeds it


class _Strict(BaseModel):  # the JobSpec sections' base (spec._Strict): unknown keys are errors
    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=True)


class ParallelSpec(_Strict):
    """How the ranks split the work: dp x tp x pp = world size, optionally FSDP-sharded."""

    dp: int | None = Field(None, ge=1, le=MAX_WORLD, description="defaults to world size / (tp * pp)")
    tp: int = Field(1, ge=1, le=MAX_WORLD, description="tensor parallel: ranks splitting each block's heads and MLP columns")
    pp: int = Field(1, ge=1, le=MAX_WORLD, description="pipeline parallel: stages, each holding consecutive blocks")
    fsdp: bool = Field(False, description="shard parameters, gradients and optimizer state over dp (FSDP2)")
    microbatches: int = Field(4, ge=1, le=1024, description="pp: micro-batches per step of each replica")
    schedule: Literal["1f1b", "gpipe"] = Field("1f1b", description="pp: the pipeline schedule")
    recompute: Literal["none", "full"] = Field(
        "none", description="full: activation checkpointing of every transformer (or residual) block: its "
                            "activations are recomputed in the backward pass instead of kept; same math, "
                            "less memory, about one more forward of compute")
    shard_optimizer: bool = Field(
        False, description="ZeRO-1: each data-parallel rank keeps the AdamW state of only its share of the "
                           "parameters and broadcasts them after its update; needs dp >= 2, not with fsdp "
                           "(which shards the optimizer state already)")


class Periods(_Strict):
    """comm.sync hierarchical: how often the models are averaged within a node and globally."""

    node: int = Field(2, ge=1, le=MAX_STEPS, description="steps between averages among a node's ranks")
    global_: int = Field(8, ge=1, le=MAX_STEPS, alias="global",
                         description="steps between averages over all ranks; a multiple of node, larger")


# The gradient compressions there are, each with its hook's arithmetic per step in units of the
# job's measured optimizer step: the profiler's cost model (jobs/attempts/policy/profiling.py says
# how each was measured). CommSpec.compression accepts exactly these keys, and the runtime sets up
# each of them (trainyard/sdk/comm.py _SETUP, tested against this table).
COMPRESSION_COST: dict[str, float] = {"none": 0.0, "fp16": 0.3, "bf16": 0.3, "powersgd": 1.5, "topk": 2.0}
Compression = Literal[tuple(COMPRESSION_COST)]  # type: ignore[valid-type]


class CommSpec(_Strict):
    """How gradients or models are synchronised between data-parallel replicas."""

    compression: Compression = Field(
        "none", description="gradient all-reduce compression (a DDP comm hook; trainyard/sdk/comm.py)")
    ratio: Union[Literal["auto"], float] = Field(
        0.01, description="topk: fraction of each gradient bucket sent, (0, 1]; auto: chosen from "
                          "measured step times")
    rank: int = Field(2, ge=1, le=1024, description="powersgd: matrix approximation rank")
    start_step: int = Field(10, ge=0, le=MAX_STEPS,
                            description="steps 1..start_step all-reduce dense gradients; compression starts after")
    sync: Literal["allreduce", "local_sgd", "hierarchical"] = Field(
        "allreduce", description="allreduce: every step's gradients; local_sgd / hierarchical: average "
                                 "whole models every few steps")
    period: int = Field(4, ge=1, le=MAX_STEPS, description="local_sgd: steps between model averages (after start_step)")
    periods: Periods = Field(Periods(), description="hierarchical: the node and global averaging periods")

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
                             f"top-k sends) or 'auto', got {echo(v)}")
        return float(v)
