"""GET /api/v1/knowledge/: the knowledge base (jobs/selectors_knowledge.py) as JSON, and the
filters and record JSON the knowledge page (/knowledge/) shares with it.

Records are those of jobs the user can see (own or team's; staff: all), newest first, paginated,
each with measured and predicted figures and the relative error. "best" is the best measured
plan per model shape and cluster over every record (aggregates: no job ids, no owners).
Filters: ?kind= (gpt|mlp), ?device= ("cpu", "cuda" for any GPU, or a device name),
?layers=, ?hidden= (positive integers); a bad value is a 400 naming it.
"""
from __future__ import annotations

import re
from typing import get_args

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.pagination import PageNumberPagination
from rest_framework.views import APIView

from jobs import selectors_knowledge
from jobs.errors import InvalidInput
from jobs.models import KnowledgeRecord
from jobs.policy.knowledge import PLAN_FIELDS, SHAPE_FIELDS, relative_error
from trainyard.spec import ModelSpec

KINDS = get_args(ModelSpec.model_fields["kind"].annotation)
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
        if raw.isdigit() and 1 <= int(raw) <= top:
            out[name] = int(raw)
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
        qs = selectors_knowledge.knowledge_filter(
            selectors_knowledge.knowledge_visible_to(request.user), **filters).order_by("-id")
        pager = KnowledgePagination()
        page = pager.paginate_queryset(qs, request, view=self)
        response = pager.get_paginated_response([record_dict(r) for r in page])
        best = selectors_knowledge.knowledge_best_table(
            selectors_knowledge.knowledge_filter(KnowledgeRecord.objects.all(), **filters))
        response.data["best"] = [best_dict(b) for b in best]
        return response

