"""A node as the API and the cluster socket return it, and what the pages show of it.

The derived figures (a GPU's one-line detail, the device summary, the drain controls on offer) are
computed here once: the server-rendered cards (jobs/fleet/views.py) use these functions, and the
serializer sends their results with every node so static/js/cluster.js only renders them.
"""
from __future__ import annotations
from rest_framework import serializers
from jobs.fleet import selectors
from jobs.models import Node

# (action, drain mode, label) offered to staff per drain_mode.
_NODE_CONTROLS = {
    "": [("cordon", "", "Cordon"), ("drain", "finish", "Drain (finish)"), ("drain", "preempt", "Drain (preempt)")],
    "cordon": [("drain", "finish", "Drain (finish)"), ("drain", "preempt", "Drain (preempt)"),
               ("uncordon", "", "Uncordon")],
    "finish": [("drain", "preempt", "Drain (preempt)"), ("uncordon", "", "Uncordon")],
    "preempt": [("uncordon", "", "Uncordon")],
}


def node_controls(drain_mode: str) -> list[dict]:
    return [{"action": a, "mode": m, "label": label}
            for a, m, label in _NODE_CONTROLS.get(drain_mode or "", _NODE_CONTROLS["cordon"])]


def cuda_devices(devices) -> list[dict]:
    """The node's GPUs, in the order its heartbeat listed them."""
    return [d for d in devices or [] if isinstance(d, dict) and d.get("kind") == "cuda"]


def gpu_detail(d: dict) -> str:
    """A GPU's NVML figures in one line: "12.0/141.0 GiB · 41 °C · 2 uncorrected ECC · Xid 79, 48";
    figures the agent did not report are left out."""
    parts = []
    if isinstance(d.get("memory_bytes"), int) and d["memory_bytes"]:
        parts.append(f"{(d.get('memory_used_bytes') or 0) / 2**30:.1f}/{d['memory_bytes'] / 2**30:.1f} GiB")
    if isinstance(d.get("temperature_c"), int):
        parts.append(f"{d['temperature_c']} °C")
    if isinstance(d.get("ecc_uncorrected"), int) and d["ecc_uncorrected"] > 0:
        parts.append(f"{d['ecc_uncorrected']} uncorrected ECC")
    xids = [str(e.get("xid")) for e in d.get("xid_events") or [] if isinstance(e, dict)]
    if xids:
        parts.append("Xid " + ", ".join(xids[-5:]) + (f" ({d.get('xid_errors')} in all)" if len(xids) > 5 else ""))
    return " · ".join(parts)


def device_summary(devices) -> str:
    """[{kind: cpu}, {kind: cpu}, {kind: cuda, name: H100}] -> "2 × cpu, 1 × cuda H100"."""
    counts: dict[str, int] = {}
    for d in devices or []:
        if isinstance(d, dict):
            key = " ".join(str(x) for x in (d.get("kind"), d.get("name")) if x)
            counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} × {k}" for k, n in counts.items())


class NodeSerializer(serializers.ModelSerializer):
    """A node with its slots in use, devices, load and drain/quarantine state, and what the pages
    show of them: `device_summary`, `gpu_details` (one line per GPU, in the order of the cuda
    entries of `devices`) and `controls` (the drain actions its drain_mode offers)."""

    slots_used = serializers.SerializerMethodField()
    device_summary = serializers.SerializerMethodField()
    gpu_details = serializers.SerializerMethodField()
    controls = serializers.SerializerMethodField()

    class Meta:
        model = Node
        fields = ["name", "status", "slots", "slots_used", "address", "labels", "devices", "device_kind",
                  "gpu_count", "gpu_memory_bytes", "cpu_percent",
                  "mem_percent", "last_heartbeat", "quarantined_at", "quarantine_reason", "drain_mode",
                  "device_summary", "gpu_details", "controls"]

    def get_slots_used(self, obj) -> int:
        used = self.context.get("slots_used")
        if used is None:
            used = self.context["slots_used"] = selectors.slots_used_by_node()
        return used.get(obj.pk, 0)

    def get_device_summary(self, obj) -> str:
        return device_summary(obj.devices)

    def get_gpu_details(self, obj) -> list[str]:
        return [gpu_detail(d) for d in cuda_devices(obj.devices)]

    def get_controls(self, obj) -> list[dict]:
        return node_controls(obj.drain_mode)
