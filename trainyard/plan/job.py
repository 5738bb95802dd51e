"""Planning a JobSpec (`parallel: auto`): the request built from the validated spec, the search
restricted to what Trainyard's runtime runs, and the chosen plan written back as spec fields."""
from __future__ import annotations

import dataclasses

from trainyard.spec import JobSpec, SpecError

from .constants import DeviceConstants
from .cost import Candidate
from .inputs import PlanInputError, parse_plan_request
from .search import plan

# The device facts a JobSpec does not carry, per resources.device, until a calibration (or the
# caller's `device=`) says better: memory and peak per process, links in GB/s one way.
KIND_DEFAULTS = {
    "cpu": {"memory_gb": 4.0, "peak_tflops": 0.2, "intra_node_gbs": 5.0, "inter_node_gbs": 1.0},
    "cuda": {"memory_gb": 80.0, "peak_tflops": 312.0, "intra_node_gbs": 300.0, "inter_node_gbs": 25.0},
}


def runtime_supports(spec: JobSpec, c: Candidate) -> bool:
    """Whether the runtime runs candidate `c` for `spec`: the concrete spec it would become passes
    trainyard.spec's own rules (no tp x pp, FSDP alone, ZeRO-1 over dp >= 2 and not under model
    averaging, compression / averaging / balancing only with plain dp, 1F1B with m >= pp, ...), so
    the planner never keeps a copy of them that could drift."""
    par, accum = spec_parallel(dataclasses.asdict(c), spec.train.global_batch)
    try:
        spec.with_parallel(par, accum)
    except SpecError:
        return False
    return True


def job_request(spec: JobSpec, *, device: dict | None = None) -> dict:
    """The planner request for a validated JobSpec's built-in model on its resources."""
    m, res = spec.model, spec.resources
    if m is None:
        raise PlanInputError({"model": ["the planner plans the built-in models; a script's own model "
                                        "(entrypoint) is planned by the script"]})
    kind = res.device
    facts = {**KIND_DEFAULTS.get(kind, KIND_DEFAULTS["cuda"]), **(device or {})}
    return {
        "model": {"layers": m.layers, "hidden": m.hidden, "seq_len": m.seq_len, "vocab": m.vocab,
                  "heads": m.heads if m.kind == "gpt" else 1},
        "cluster": {"nodes": res.nodes, "devices_per_node": res.procs_per_node,
                    "device": {"name": facts.get("name", kind), "memory_gb": float(facts["memory_gb"]),
                               "peak_tflops": float(facts["peak_tflops"])},
                    "intra_node_gbs": float(facts["intra_node_gbs"]),
                    "inter_node_gbs": float(facts["inter_node_gbs"])},
        "global_batch": spec.train.global_batch,
        "precision": "fp32" if kind == "cpu" else "bf16",
    }


def plan_for_job(spec: JobSpec, constants: DeviceConstants | None, *, device: dict | None = None,
                 limit_rejected: int = 200) -> dict:
    """The planner's output for a validated JobSpec, restricted to plans our
    runtime runs (an mlp is costed as a GPT of its size with one head, dp / fsdp only). `device` overrides {name, memory_gb, peak_tflops, intra_node_gbs,
    inter_node_gbs}; PlanInputError when the spec's shape is no GPT the planner can split."""
    req = parse_plan_request(job_request(spec, device=device))
    def runnable(c: Candidate) -> bool:
        return runtime_supports(spec, c)

    return plan(req, constants, limit_rejected=limit_rejected, runnable=runnable)


def spec_parallel(row: dict, global_batch: int) -> tuple[dict, int]:
    """(the spec's `parallel` section, train.grad_accum) for a plan row: pp > 1 -> microbatches =
    per-replica batch / micro_batch and grad_accum 1; pp == 1 -> grad_accum = that ratio."""
    m = global_batch // row["dp"] // row["micro_batch"]
    par = {"dp": row["dp"], "tp": row["tp"], "pp": row["pp"], "fsdp": row["fsdp"],
           "shard_optimizer": row["shard_optimizer"], "recompute": row["recompute"]}
    if row["pp"] > 1:
        par.update(microbatches=m, schedule=row["schedule"])
        return par, 1
    return par, m
