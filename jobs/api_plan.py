"""POST /api/v1/plan/: the planner (DESIGN.md "Planner I/O"). Any logged-in user; bad input is a
400 naming each field (PlanInputError, SpecError through jobs.api_errors); nothing is stored.

Two bodies: the planner's own request ({model, cluster, global_batch, precision, fix}), or
{"spec": <JobSpec>}, planned as a submit would plan it on this cluster (jobs/autoplan.py: the
nodes' devices, the calibrated constants, the runtime's strategies): the submit page's preview."""
from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView

from django.conf import settings

from trainyard.spec import SpecError, parse_job_spec

from jobs.autoplan import plan_spec
from jobs.planning import plan_document


def spec_document(data) -> dict:
    """The plan document of a JobSpec (SpecError when it is invalid or has no built-in GPT)."""
    parsed = parse_job_spec(data, data_root=settings.TRAINYARD_DATA_ROOT)
    if parsed.model is None or parsed.model.kind != "gpt":
        raise SpecError({"model": ["the planner plans the built-in gpt model; an entrypoint or mlp job runs "
                                   "data parallel over its processes"]})
    return plan_spec(parsed.to_json())


class PlanView(APIView):
    @extend_schema(request={"application/json": {"type": "object", "properties": {
        "model": {"type": "object"}, "cluster": {"type": "object"}, "global_batch": {"type": "integer"},
        "precision": {"type": "string", "enum": ["bf16", "fp32"]}, "fix": {"type": "object"}}}},
        responses={200: {"type": "object", "properties": {"plans": {"type": "array", "items": {"type": "object"}},
                                                          "rejected": {"type": "array", "items": {"type": "object"}}}}})
    def post(self, request):
        """Every feasible plan for the model on the cluster, best first, and the nearest misses
        with the reason each does not fit."""
        data = request.data
        if isinstance(data, dict) and "spec" in data:
            return Response(spec_document(data["spec"]))
        return Response(plan_document(data))
