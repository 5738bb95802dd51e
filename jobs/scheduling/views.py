"""The quotas page (staff).
"""
from __future__ import annotations
from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.shortcuts import render
from jobs.scheduling import selectors
from jobs.models import QuotaChange


def _quota_text(q: dict | None) -> str:
    """A QuotaChange's old/new: {"max_slots": 8, "device_hours": 100.0} -> "8 slots, 100 device-h"."""
    if not q:
        return "none"
    hours = q.get("device_hours")
    return f"{q.get('max_slots')} slots, " + ("no device-hour limit" if hours is None else f"{_hours(hours)} device-h")


def _hours(v: float) -> str:
    return f"{v or 0.0:.2f}".rstrip("0").rstrip(".")


def _quota_changes(limit: int = 50) -> list[QuotaChange]:
    changes = list(QuotaChange.objects.select_related("actor").order_by("-id")[:limit])
    for c in changes:
        c.old_text, c.new_text = _quota_text(c.old), _quota_text(c.new)
    return changes


@login_required
def quota_list(request):
    """Quotas per team (and per user with one), usage, and the audit log (staff). `?part=audit`
    renders the audit log alone: static/js/quotas.js refreshes it after a save."""
    if not request.user.is_staff:
        raise PermissionDenied("only staff may manage quotas")
    changes = _quota_changes()
    if request.GET.get("part") == "audit":
        return render(request, "jobs/_quota_audit.html", {"changes": changes})
    rows = selectors.quota_table()
    for r in rows:  # "3.25 / 100" like static/js/quotas.js
        r["hours_text"] = _hours(r["device_hours_used"]) + (
            f" / {_hours(r['device_hours'])}" if r["device_hours"] is not None else "")
    window_h = settings.TRAINYARD_QUOTA_WINDOW_S / 3600
    return render(request, "jobs/quota_list.html", {
        "rows": rows, "changes": changes,
        "window": f"{window_h / 24:g} days" if window_h >= 48 else f"{window_h:g} h"})
