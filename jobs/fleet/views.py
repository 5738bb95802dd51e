"""The nodes page and its control-plane panel.
"""
from __future__ import annotations
from django.contrib.auth.decorators import login_required
from django.http import JsonResponse
from django.shortcuts import render
from jobs.fleet import liveness, selectors
from jobs.models import Node, NodeJoinRequest


def nodes_for_page() -> list[Node]:
    nodes = list(Node.objects.order_by("name"))
    used = selectors.slots_used_by_node()
    for n in nodes:
        n.slots_used = used.get(n.pk, 0)
        n.slots_free = max(0, n.slots - n.slots_used)
        n.slot_marks = [i < n.slots_used for i in range(n.slots)]
        n.gpus = [dict(d, detail=gpu_detail(d)) for d in (n.devices or [])
                  if isinstance(d, dict) and d.get("kind") == "cuda"]
        n.device_summary = _device_summary(n.devices)
        n.controls = _node_controls(n.drain_mode)
    return nodes


# (action, drain mode, label) offered to staff per drain_mode; static/js/cluster.js mirrors this.
_NODE_CONTROLS = {
    "": [("cordon", "", "Cordon"), ("drain", "finish", "Drain (finish)"), ("drain", "preempt", "Drain (preempt)")],
    "cordon": [("drain", "finish", "Drain (finish)"), ("drain", "preempt", "Drain (preempt)"),
               ("uncordon", "", "Uncordon")],
    "finish": [("drain", "preempt", "Drain (preempt)"), ("uncordon", "", "Uncordon")],
    "preempt": [("uncordon", "", "Uncordon")],
}


def _node_controls(drain_mode: str) -> list[dict]:
    return [{"action": a, "mode": m, "label": label}
            for a, m, label in _NODE_CONTROLS.get(drain_mode or "", _NODE_CONTROLS["cordon"])]


def gpu_detail(d: dict) -> str:
    """A GPU's NVML figures in one line: "12.0/141.0 GiB · 41 °C · 2 uncorrected ECC · Xid 79, 48"
    (static/js/cluster.js gpuDetail mirrors it); figures the agent did not report are left out."""
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


def _device_summary(devices) -> str:
    """[{kind: cpu}, {kind: cpu}, {kind: cuda, name: H100}] -> "2 × cpu, 1 × cuda H100"."""
    counts: dict[str, int] = {}
    for d in devices or []:
        if isinstance(d, dict):
            key = " ".join(str(x) for x in (d.get("kind"), d.get("name")) if x)
            counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} × {k}" for k, n in counts.items())


@login_required
def node_list(request):
    # Staff see the heartbeats refused from unregistered nodes (issue 16), to approve in the admin.
    joins = list(NodeJoinRequest.objects.all()[:50]) if request.user.is_staff else []
    return render(request, "jobs/node_list.html", {"nodes": nodes_for_page(), "join_requests": joins,
                                                   **_control_plane(request.user)})


def _control_plane(user) -> dict:
    """The nodes page's "Control plane" panel: every process's liveness (jobs/liveness.py) and, for
    staff, what `make run`'s supervisor knows (pids, restarts, last exit)."""
    rows = liveness.processes()
    for row in rows:
        row["age_text"] = "never" if row["age_s"] is None else f"{row['age_s']:.0f} s ago"
    sup = liveness.supervisor() if user.is_staff else None
    if sup is not None:
        sup = {"up": sup["up"], "age_s": sup["age_s"],
               "rows": [dict(p, process=name) for name, p in sup.pop("processes").items()]}
    return {"processes": rows, "supervisor": sup}


@login_required
def control_plane(request):
    """JSON of the panel, which static/js/controlplane.js fetches every 5 s: the one thing on the pages
    that polls, because what pushes the other updates (the control worker, the relay) is what it
    must be able to show dead."""
    data = _control_plane(request.user)
    return JsonResponse({"processes": [{k: r[k] for k in ("process", "up", "age_s")} for r in data["processes"]],
                         "supervisor": data["supervisor"]})
