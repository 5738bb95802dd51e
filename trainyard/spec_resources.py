"""The JobSpec's `resources` section (trainyard/spec.py): nodes, processes per node, device and
node labels. `nodes` is a number, or `{min: M, max: N}` for an elastic job: it may start, run and
resume on any node count in [M, N] (the scheduler chooses; docs/architecture.md, "Adaptive and
elastic"). The stored form keeps `nodes` as the most (N) and `min_nodes` as the least (M); a
fixed-size job has `min_nodes` null."""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, model_validator

from .spec_parallel import _Strict

MAX_LABELS = 16
MAX_GPU_MEMORY_GB = 4096
MAX_NODES = 4096
_LABEL_KEY = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._/-]{0,61}[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?")
POOL_NAME = r"^[a-z][a-z0-9-]{0,30}[a-z0-9]$"


def _check_labels(labels: dict[str, str]) -> dict[str, str]:
    # The charset of an agent's --labels (key=value pairs split on "," and "="), kept to what
    # reads unambiguously in "no READY node has labels gpu=a100": 1-63 characters each.
    if len(labels) > MAX_LABELS:
        raise ValueError(f"at most {MAX_LABELS} labels, got {len(labels)}")
    for key, value in labels.items():
        if not _LABEL_KEY.fullmatch(key):
            raise ValueError(f"label {key[:70]!r}: a key is 1-63 letters, digits, '.', '_', '-' or '/', "
                             f"starting and ending with a letter or digit")
        if not _LABEL_VALUE.fullmatch(value):
            raise ValueError(f"label {key}: value {value[:70]!r} must be 1-63 letters, digits, '.', '_' or '-', "
                             f"starting and ending with a letter or digit")
    return labels


NodeLabels = Annotated[dict[str, str], AfterValidator(_check_labels)]


class ResourcesSpec(_Strict):
    """What the job occupies: nodes x processes per node, on one kind of device."""

    nodes: int = Field(2, ge=1, le=MAX_NODES, description="machines the job spans (a gang: all or none start); "
                                                          "{min: M, max: N}: elastic, any count in [M, N]")
    min_nodes: int | None = Field(None, ge=1, le=MAX_NODES,
                                  description="elastic: the fewest nodes the job runs on (nodes is the most); "
                                              "null: exactly nodes. Written as nodes: {min, max}")
    procs_per_node: int = Field(1, ge=1, le=64, description="training processes (ranks) per node")
    device: Literal["cpu", "cuda"] = Field("cpu", description="cuda: one GPU per process, only on nodes whose "
                                                              "agent reports GPUs")
    gpu_memory_gb: float | None = Field(None, gt=0, le=MAX_GPU_MEMORY_GB,
                                        description="cuda: only GPUs with at least this much memory each "
                                                    "(GB = 1e9 bytes); null: any")
    labels: NodeLabels = Field(default_factory=dict, description="node selector: run only on nodes carrying "
                                                                 "every one of these labels (the agents' --labels), "
                                                                 "e.g. {gpu: a100, rack: r2}")
    pool: str | None = Field(None, pattern=POOL_NAME,
                             description="where the job runs: null = Trainyard's own node agents; the name of a "
                                         "pool staff configured (a Slurm cluster: the job runs on nodes Slurm "
                                         "allocates for each attempt)")

    @model_validator(mode="before")
    @classmethod
    def _elastic_form(cls, data: Any) -> Any:
        # nodes: {min: M, max: N} -> nodes N, min_nodes M (the stored form)
        if isinstance(data, dict) and isinstance(data.get("nodes"), dict):
            rng = data["nodes"]
            extra = sorted(set(rng) - {"min", "max"})
            if extra or "min" not in rng or "max" not in rng:
                raise ValueError("nodes is a number or {min: M, max: N}"
                                 + (f" (unknown keys: {', '.join(map(str, extra))})" if extra else ""))
            if "min_nodes" in data:
                raise ValueError("give the elastic range once: nodes {min, max} or min_nodes, not both")
            data = {**data, "nodes": rng["max"], "min_nodes": rng["min"]}
        return data

    @model_validator(mode="after")
    def _range(self) -> "ResourcesSpec":
        if self.min_nodes is not None and self.min_nodes > self.nodes:
            raise ValueError(f"nodes: min ({self.min_nodes}) must not exceed max ({self.nodes})")
        return self

    @property
    def world_size(self) -> int:
        """Processes in the job: nodes x procs_per_node."""
        return self.nodes * self.procs_per_node

    @property
    def elastic(self) -> bool:
        """The job may run on fewer nodes than `nodes` (min_nodes set and below it)."""
        return self.min_nodes is not None and self.min_nodes < self.nodes

    @property
    def node_counts(self) -> range:
        """Every node count the job may run on: [min_nodes, nodes], or just nodes."""
        return range(self.min_nodes or self.nodes, self.nodes + 1)
