"""The nodes page and its control-plane panel.
"""
from __future__ import annotations
from django.contrib.auth.decorators import login_required
from django.http import JsonResponse
from django.shortcuts import render
from jobs.fleet import liveness, selectors
from jobs.fleet.serializers import cuda_devices, device_summary, gpu_detail, node_controls
from jobs.models import Node, NodeJoinRequest


def nodes_for_page() -> list[Node]:
    nodes = list(Node.objects.order_by("name"))
    used = selectors.slots_used_by_node()
    for n in nodes:
        n.slots_used = used.get(n.pk, 0)
        n.slots_free = max(0, n.slots - n.slots_used)
        n.slot_marks = [i < n.slots_used for i in range(n.slots)]
        n.gpus = [dict(d, detail=gpu_detail(d)) for d in cuda_devices(n.devices)]
        n.device_summary = device_summary(n.devices)
        n.controls = node_controls(n.drain_mode)
    return nodes


@login_required
def node_list(request):
    # Staff see the heartbeats refused from unregistered nodes (issue 16), to approve in the admin.
    joins = list(NodeJoinRequest.objects.all()[:50]) if request.user.is_staff else []
    return render(request, "jobs/node_list.html", {"nodes": nodes_for_page(), "join_requests": joins,
                                                   **_control_plane(request.user)})


def _control_plane(user) -> dict:
    """The nodes page's "Control plane" panel: every process's liveness (jobs/fleet/liveness.py) and, for
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
