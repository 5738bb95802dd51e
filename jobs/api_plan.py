"""POST /api/v1/plan/: the planner (DESIGN.md "Planner I/O"). Any logged-in user; bad input is a
400 naming each field (PlanInputError through jobs.api_errors); nothing is stored."""
from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView

from .planning import plan_document


class PlanView(APIView):
    @extend_schema(request={"application/json": {"type": "object", "properties": {
        "model": {"type": "object"}, "cluster": {"type": "object"}, "global_batch": {"type": "integer"},
        "precision": {"type": "string", "enum": ["bf16", "fp32"]}, "fix": {"type": "object"}}}},
        responses={200: {"type": "object", "properties": {"plans": {"type": "array", "items": {"type": "object"}},
                                                          "rejected": {"type": "array", "items": {"type": "object"}}}}})
    def post(self, request):
        """Every feasible plan for the model on the cluster, best first, and the nearest misses
        with the reason each does not fit."""
        return Response(plan_document(request.data))
