"""The retention API: GET /api/v1/retention/ (the site's settings and the teams'; a non-staff user sees the
site's and their own teams' rows), PUT (staff: change them, all or nothing; 400 with field errors).
"""
from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView

from jobs.core.http import require_staff
from jobs.telemetry import retention_settings as retention

_FIELDS = {
    "rank_window_steps": {"type": "integer", "nullable": True, "minimum": 1},
    "rank_sampled_per_rank": {"type": "integer", "nullable": True, "minimum": 0},
    **{f: {"type": "number", "nullable": True, "minimum": 0} for f in retention.DAY_FIELDS},
}


class RetentionView(APIView):
    """GET: the telemetry retention settings: `site` (its stored fields, empty ones using `defaults`, and
    `effective`), `teams` (each team row's own fields, which override the site's, and `effective`).
    Staff see every team's row; anyone else the site's and their own teams'. PUT (staff):
    {"site": {field: value|null}, "teams": [{"team": name, field: value|null}]}, all or nothing; a field
    left out keeps its value, null clears it, a team row whose fields are all empty is removed. Applied by
    the next purge (every TRAINYARD_TELEMETRY_PURGE_S)."""

    @extend_schema(responses={200: {"type": "object"}})
    def get(self, request):
        teams = None if request.user.is_staff else list(request.user.groups.values_list("pk", flat=True))
        return Response(retention.retention_table(teams=teams))

    @extend_schema(request={"application/json": {"type": "object", "properties": {
        "site": {"type": "object", "properties": _FIELDS},
        "teams": {"type": "array", "items": {"type": "object", "properties": {"team": {"type": "string"}, **_FIELDS}}}}}},
        responses={200: {"type": "object"}})
    def put(self, request):
        require_staff(request, "change retention settings")
        retention.retention_update(actor=request.user, data=request.data)
        return self.get(request)
