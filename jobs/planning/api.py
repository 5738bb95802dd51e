"""POST /api/v1/plan/: the planner (DESIGN.md "Planner I/O"). Any logged-in user; bad input is a
400 naming each field (PlanInputError, SpecError through jobs.core.api_errors); nothing is stored.

Two bodies: the planner's own request ({model, cluster, global_batch, precision, fix}), or
{"spec": <JobSpec>}, planned as a submit would plan it on this cluster (jobs/planning/autoplan.py: the
nodes' devices, the calibrated constants, the runtime's strategies): the submit page's preview."""
from __future__ import annotations
from drf_spectacular.utils import extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView
from django.conf import settings
from trainyard.spec import SpecError, parse_job_spec
from jobs.planning.autoplan import plan_spec
from jobs.planning.constants import plan_document
import re
from typing import get_args
from drf_spectacular.utils import OpenApiParameter
from rest_framework.pagination import PageNumberPagination
from jobs.planning import selectors as planning_selectors
from jobs.core.errors import InvalidInput
from jobs.models import KnowledgeRecord
from jobs.planning.policy.knowledge import PLAN_FIELDS, SHAPE_FIELDS, relative_error
from trainyard.spec import ModelSpec
from trainyard.textdoc import whole_number
from rest_framework import status
from jobs.core.dbtext import text_problem
from jobs.core.errors import Forbidden
from jobs.models import Calibration
from jobs.planning.services import calibration as calibration_services


def spec_document(data) -> dict:
    """The plan document of a JobSpec (SpecError when it is invalid or has no built-in GPT)."""
    parsed = parse_job_spec(data, data_root=settings.TRAINYARD_DATA_ROOT)
    if parsed.model is None or parsed.model.kind != "gpt":
        raise SpecError({"model": ["the planner plans the built-in gpt model; an entrypoint or mlp job runs "
                                   "data parallel over its processes"]})
    return plan_spec(parsed)


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


KINDS = (*get_args(ModelSpec.model_fields["kind"].annotation), "user")  # user: a model run.prepare described
DEVICE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._()/+-]{0,127}")
FILTER_BOUNDS = {"layers": 100_000, "hidden": 10_000_000}
GB = 1e9


def parse_filters(params) -> dict:
    """{kind, device, layers, hidden} from query parameters (absent or empty: None). Raises
    InvalidInput naming each bad one."""
    out: dict = {"kind": None, "device": None, "layers": None, "hidden": None}
    errors: dict[str, list[str]] = {}
    kind = (params.get("kind") or "").strip()
    if kind:
        if kind in KINDS:
            out["kind"] = kind
        else:
            errors["kind"] = [f"must be one of {', '.join(KINDS)}, got {kind!r}"]
    device = (params.get("device") or "").strip()
    if device:
        if DEVICE_NAME.fullmatch(device):
            out["device"] = device
        else:
            errors["device"] = ['must be "cpu", "cuda" (any GPU) or a device name of at most 128 letters, digits, '
                                f"spaces and ._()/+-, got {device[:40]!r}"]
    for name, top in FILTER_BOUNDS.items():
        raw = (params.get(name) or "").strip()
        if not raw:
            continue
        if (value := whole_number(raw)) is not None and 1 <= value <= top:
            out[name] = value
        else:
            errors[name] = [f"must be a whole number from 1 to {top:,}, got {raw[:40]!r}"]
    if errors:
        raise InvalidInput(errors)
    return out


def record_dict(r: KnowledgeRecord) -> dict:
    """One record: shape, plan, where it ran, measured, predicted (planner) and the relative error
    (predicted - measured) / measured."""
    mem_gb = r.mem_bytes / GB if r.mem_bytes else None
    return {
        "id": r.pk, "job": r.job_id, "job_name": r.job.name if r.job_id else None,
        "attempt": r.attempt.number if r.attempt_id else None, "created_at": r.created_at.isoformat(),
        "model": None if r.kind is None else {k: getattr(r, k) for k in (*SHAPE_FIELDS, "params")},
        "global_batch": r.global_batch, "plan": {k: getattr(r, k) for k in PLAN_FIELDS},
        "cluster": {"nodes": r.nodes, "procs_per_node": r.procs_per_node, "world": r.world, "device": r.device_name},
        "measured": {"step_time_s": r.step_time_s, "warm_steps": r.warm_steps, "mem_bytes": r.mem_bytes,
                     "memory_gb": mem_gb, "tokens_per_s": r.tokens_per_s, "tflops_per_device": r.tflops_per_device},
        "predicted": {"step_time_s": r.predicted_step_time_s, "memory_gb": r.predicted_memory_gb},
        "error": {"step_time": relative_error(r.predicted_step_time_s, r.step_time_s),
                  "memory": relative_error(r.predicted_memory_gb, mem_gb)},
    }


def best_dict(b: dict) -> dict:
    return {"model": {k: b[k] for k in SHAPE_FIELDS}, "global_batch": b["global_batch"],
            "cluster": {"nodes": b["nodes"], "procs_per_node": b["procs_per_node"],
                        "world": b["nodes"] * b["procs_per_node"], "device": b["device_name"]},
            "plan": b["plan"], "tokens_per_s": b["tokens_per_s"], "step_time_s": b["step_time_s"],
            "tflops_per_device": b["tflops_per_device"], "mem_bytes": b["mem_bytes"], "runs": b["runs"],
            "plans_compared": b["plans_compared"], "runner_up_tokens_per_s": b["runner_up_tokens_per_s"]}


class KnowledgePagination(PageNumberPagination):
    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 500


class KnowledgeView(APIView):
    """Past configurations with predicted vs measured step time and memory, and the best known
    plan per model shape and cluster."""

    @extend_schema(parameters=[
        OpenApiParameter("kind", str, enum=list(KINDS)),
        OpenApiParameter("device", str, description='"cpu", "cuda" (any GPU) or a device name'),
        OpenApiParameter("layers", int), OpenApiParameter("hidden", int),
        OpenApiParameter("page", int), OpenApiParameter("page_size", int)],
        responses={200: {"type": "object"}})
    def get(self, request):
        filters = parse_filters(request.query_params)
        qs = planning_selectors.knowledge_filter(
            planning_selectors.knowledge_visible_to(request.user), **filters).order_by("-id")
        pager = KnowledgePagination()
        page = pager.paginate_queryset(qs, request, view=self)
        response = pager.get_paginated_response([record_dict(r) for r in page])
        best = planning_selectors.knowledge_best_table(
            planning_selectors.knowledge_filter(KnowledgeRecord.objects.all(), **filters))
        response.data["best"] = [best_dict(b) for b in best]
        return response


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
