"""The quotas API: read (own and team's; staff all) and replace (staff, all or nothing).
"""
from __future__ import annotations
from drf_spectacular.utils import extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView
from jobs.core.http import require_staff
from jobs.scheduling import selectors
from jobs.scheduling.services import quotas as scheduling_services_quotas


class QuotaView(APIView):
    """GET: every team's (and quota'd user's) quota, in use, borrowed, queued demand and device-hours
    used in the rolling window; staff see every row, anyone else only their own teams' and their own
    (another team's usage is not theirs to read, as the staff-only quota page). PUT (staff): one quota object or a list; all or nothing; takes
    effect at the next scheduling tick and lands in the quota audit log."""

    @extend_schema(responses={200: {"type": "object"}})
    def get(self, request):
        rows = selectors.quota_table()
        if not request.user.is_staff:
            mine = set(request.user.groups.values_list("name", flat=True))
            rows = [r for r in rows if r["team"] in mine or r["user"] == request.user.get_username()]
        return Response({"count": len(rows), "next": None, "previous": None, "results": rows})

    @extend_schema(request={"application/json": {"type": "array", "items": {"type": "object", "properties": {
        "team": {"type": "string"}, "user": {"type": "string"}, "max_slots": {"type": "integer"},
        "device_hours": {"type": "number", "nullable": True}}}}}, responses={200: {"type": "object"}})
    def put(self, request):
        require_staff(request, "change quotas")
        scheduling_services_quotas.quotas_update(actor=request.user, entries=request.data)
        return self.get(request)
