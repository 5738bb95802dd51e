"""Which nodes a job may run on at all: its device (cpu | cuda), the memory of each GPU, and its
node selector (`resources.labels`, every pair must match the node's labels). And why, when no
node can serve it: the reason the queue shows ("no READY node has cuda devices").

What a node offers comes from its agent's heartbeat (`devices`, workers/gpus.py through NVML on a
cuda agent, one "cpu" entry per slot on a cpu agent), summarised by `summarize_devices` and stored
on the Node (kind, GPU count, the smallest GPU's memory). A cuda job takes one slot per GPU, so
a GPU node offers min(slots, GPUs advertised) slots (`node_slots`): a GPU that fell off the bus
(or an NVML query that failed this heartbeat: no devices) takes its slot away. A cpu job keeps
today's behaviour: any node, any slot.

Before this, `resources.device: cuda` on a CPU-only cluster was placed on a CPU node and failed
there with `AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'`.
"""
from __future__ import annotations

from typing import Iterable, Mapping

from jobs.scheduling.policy.cluster import NodeState, QueuedJob

GB = 1e9  # the spec's gpu_memory_gb and the planner's GB


def job_requirement(resources: Mapping) -> dict:
    """A stored spec's `resources` as QueuedJob's placement fields (device, gpu_memory_bytes,
    labels as sorted pairs); a spec stored before these fields reads as a plain cpu job."""
    mem = resources.get("gpu_memory_gb") or 0
    labels = resources.get("labels") or {}
    return {"device": resources.get("device", "cpu"), "gpu_memory_bytes": int(mem * GB),
            "labels": tuple(sorted((str(k), str(v)) for k, v in labels.items())),
            "pool": resources.get("pool") or ""}


def node_slots(slots: int, kind: str, gpus: int) -> int:
    """The slots a node offers the scheduler: one per GPU on a GPU node (never more than staff
    registered), its registered slots otherwise."""
    return min(slots, gpus) if kind == "cuda" else slots


def labels_text(labels: Iterable[tuple[str, str]]) -> str:
    return ", ".join(f"{k}={v}" for k, v in labels)


def restricted(job: QueuedJob) -> bool:
    """Does the job restrict its nodes (a cuda device, a node selector, a pool)? A plain cpu job does not."""
    return job.device != "cpu" or bool(job.labels) or bool(job.pool)


def _has_device(node: NodeState, job: QueuedJob) -> bool:
    return job.device == "cpu" or (node.device == job.device and node.gpus > 0)


def _has_memory(node: NodeState, job: QueuedJob) -> bool:
    return job.device == "cpu" or node.gpu_memory_bytes >= job.gpu_memory_bytes


def _has_labels(node: NodeState, job: QueuedJob) -> bool:
    if not job.labels:
        return True
    have = dict(node.labels)
    return all(have.get(k) == v for k, v in job.labels)


def eligible(node: NodeState, job: QueuedJob) -> bool:
    """May the job's processes run on this node (whatever its status and load)? A pool's seats run
    only that pool's jobs, and a pool's jobs only there."""
    return node.pool == job.pool and _has_device(node, job) and _has_memory(node, job) and _has_labels(node, job)


def _unit(job: QueuedJob) -> str:
    return f"{job.device} GPU(s)" if job.device != "cpu" else "slot(s)"


def unservable_reason(nodes: Iterable[NodeState], job: QueuedJob, *, schedulable_only: bool = True) -> str | None:
    """Why no set of these nodes could ever run the job (all of them empty), or None when some
    could. `schedulable_only`: only nodes taking work count ("no READY node has ..."); else every
    registered node (the submit's warning: "no registered node has ...")."""
    where = "READY" if schedulable_only else "registered"
    pool = [n for n in nodes if (n.schedulable or not schedulable_only) and n.pool == job.pool]
    what = ""
    if job.pool and not pool:
        return f"no {where} node in pool {job.pool}"
    if job.device != "cpu":
        pool = [n for n in pool if _has_device(n, job)]
        what = f" {job.device} devices"
        if not pool:
            return f"no {where} node has{what}"
        if job.gpu_memory_bytes:
            largest = max(n.gpu_memory_bytes for n in pool)
            pool = [n for n in pool if _has_memory(n, job)]
            what += f" of at least {job.gpu_memory_bytes / GB:g} GB each"
            if not pool:
                return f"no {where} node has{what} (the largest have {largest / GB:.1f} GB)"
    if job.labels:
        pool = [n for n in pool if _has_labels(n, job)]
        if not pool:
            return f"no {where} node{' with' + what if what else ''} has labels {labels_text(job.labels)}"
    if sum(1 for n in pool if n.slots >= job.procs_per_node) >= job.nodes:
        return None
    if not restricted(job):
        return None  # the plain slot shortage: the caller's own message
    most = max(n.slots for n in pool)
    sel = f" with labels {labels_text(job.labels)}" if job.labels else ""
    sel += f" in pool {job.pool}" if job.pool else ""
    return (f"needs {job.nodes} {where} node(s) with {job.procs_per_node} {_unit(job)} each{sel}; "
            f"{len(pool)} such node(s), with at most {most}")
