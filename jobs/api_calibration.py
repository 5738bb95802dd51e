"""Calibrations: GET /api/v1/calibrations/ (any user: the stored calibrations, newest first,
?device=<name> for one device type; ?measurements=1 adds each row's measurement document) and
POST /api/v1/calibrations/ {"node": name, "quick": bool} (staff: the node's agent measures it and
the control plane stores the fit when its report arrives) -> 202."""
from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.pagination import PageNumberPagination
from rest_framework.response import Response
from rest_framework.views import APIView

from jobs.dbtext import text_problem
from jobs.errors import Forbidden, InvalidInput
from jobs.models import Calibration
from jobs.services import calibration as calibration_services


def _brief(evaluation: dict, key: str) -> dict | None:
    e = evaluation.get(key)
    return None if e is None else {k: v for k, v in e.items() if k != "per_run"}


def calibration_dict(row: Calibration, *, measurements: bool = False) -> dict:
    ev = row.evaluation or {}
    out = {"id": row.pk, "device_name": row.device_name, "kind": row.kind, "node": row.node,
           "created_at": row.created_at.isoformat(),
           "created_by": row.created_by.username if row.created_by_id else None,
           "peak_tflops": row.peak_tflops, "runs": len((row.measurements or {}).get("runs", [])),
           "constants": row.constants, "held_out": ev.get("held_out", []),
           "before": _brief(ev, "before"), "after": _brief(ev, "after"),
           "per_run": (ev.get("after") or {}).get("per_run", [])}
    if measurements:
        out["measurements"] = row.measurements
    return out


class CalibrationView(APIView):
    @extend_schema(parameters=[OpenApiParameter("device", str), OpenApiParameter("measurements", bool)],
                   responses={200: {"type": "object"}})
    def get(self, request):
        """Stored calibrations, newest first (paginated)."""
        rows = Calibration.objects.select_related("created_by").order_by("-id")
        device = request.query_params.get("device")
        if device and (why := text_problem(device)):
            raise InvalidInput({"device": [why]})
        if device:
            rows = rows.filter(device_name=device)
        pager = PageNumberPagination()
        page = pager.paginate_queryset(rows, request, view=self)
        full = request.query_params.get("measurements") in ("1", "true")
        return pager.get_paginated_response([calibration_dict(r, measurements=full) for r in page])

    @extend_schema(request={"application/json": {"type": "object", "properties": {
        "node": {"type": "string"}, "quick": {"type": "boolean"}}, "required": ["node"]}},
        responses={202: {"type": "object"}})
    def post(self, request):
        """Calibrate a READY, idle node (staff)."""
        if not request.user.is_staff:
            raise Forbidden("only staff may calibrate nodes")
        body = request.data if isinstance(request.data, dict) else {}
        unknown = sorted(set(body) - {"node", "quick"})
        if unknown:
            raise InvalidInput({k: ["unknown key"] for k in unknown})
        node = calibration_services.calibration_request(body.get("node"), quick=body.get("quick", False),
                                                        user=request.user)
        return Response({"node": node.name, "quick": body.get("quick", False), "status": "requested"},
                        status=status.HTTP_202_ACCEPTED)
