"""REST API under /api/v1/ (docs/architecture.md, section 7). Thin: parse, check access, call one service.

Errors are raised, never returned: jobs.api_errors.exception_handler turns every domain error
(jobs/errors.py, trainyard.spec.SpecError) and DRF's own into {"errors": {"field.path": [...]}}.
"""
from __future__ import annotations

from django.conf import settings
from django.http import FileResponse
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.pagination import PageNumberPagination
from rest_framework.response import Response
from rest_framework.views import APIView

from trainyard.safefs import UnsafePath
from trainyard.textdoc import echo

from jobs import keptlogs, selectors, services
from jobs.dbtext import text_problem
from jobs.errors import Forbidden, InvalidInput, NotFound
from jobs.models import Node
from jobs.rows import event_row
from jobs.serializers import CheckpointSerializer, JobSerializer, JobSubmittedSerializer, MetricSerializer, NodeSerializer
from jobs.throttles import SubmitThrottle

MAX_METRICS_LIMIT = 10_000
MAX_LOG_LIMIT = 5000


class CheckpointPagination(PageNumberPagination):  # also the events timeline
    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 500


def _require_staff(request, what: str) -> None:
    if not request.user.is_staff:
        raise Forbidden(f"only staff may {what}")


# The database's integers are 64-bit: a larger parameter would raise OverflowError in the query (a 500).
MAX_DB_INT = 2**63 - 1


def _int_param(request, name: str, *, minimum: int = 0, maximum: int = MAX_DB_INT, default=None):
    raw = request.query_params.get(name)
    if raw in (None, ""):
        return default
    value = None
    if len(raw) <= 20:  # int() of a 100,000-digit string costs; 20 digits hold every valid value
        try:
            value = int(raw)
        except ValueError:
            pass
    if value is None:
        raise ValidationError({name: [f"must be a whole number from {minimum} to {maximum}, got {echo(raw)}"]})
    if not minimum <= value <= maximum:
        raise ValidationError({name: [f"must be between {minimum} and {maximum}"]})
    return value


class JobViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = JobSerializer

    def get_throttles(self):
        # a submission counts against the stricter submit rate as well as the user's own
        return [*super().get_throttles(), *([SubmitThrottle()] if self.action == "create" else [])]

    def get_queryset(self):
        return selectors.jobs_visible_to(self.request.user).prefetch_related(
            "attempts__allocations__node").annotate(has_telemetry=selectors.has_telemetry_expr()).order_by("-id")

    @extend_schema(request={"application/json": {"type": "object", "description": "JobSpec (docs/architecture.md, section 7)"}},
                   responses={201: JobSubmittedSerializer})
    def create(self, request):
        if not isinstance(request.data, dict):
            raise ValidationError({"spec": ["send the JobSpec as a JSON object"]})
        job = services.job_submit(user=request.user, spec=dict(request.data))
        return Response(JobSubmittedSerializer(job, context={"request": request}).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={202: JobSerializer})
    @action(detail=True, methods=["post"])
    def cancel(self, request, pk=None):
        job = self.get_object()
        if not (request.user.is_staff or job.owner_id == request.user.pk):
            raise Forbidden("only the job's owner or staff may cancel it")
        job = services.job_cancel(job, user=request.user)
        return Response(JobSerializer(job, context={"request": request}).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(parameters=[OpenApiParameter("since_step", int), OpenApiParameter("rank", int),
                               OpenApiParameter("limit", int),
                               OpenApiParameter("attempt", int, description="one attempt's own samples; by default "
                                                "each step once, as the charts show it after restarts/rollbacks")],
                   responses=MetricSerializer(many=True))
    @action(detail=True, methods=["get"], pagination_class=None)
    def metrics(self, request, pk=None):
        job = self.get_object()
        rows = selectors.job_metrics(
            job, since_step=_int_param(request, "since_step"), rank=_int_param(request, "rank"),
            limit=_int_param(request, "limit", minimum=1, maximum=MAX_METRICS_LIMIT, default=1000),
            attempt=_int_param(request, "attempt"))
        return Response(MetricSerializer(rows, many=True).data)

    @extend_schema(responses={200: {"type": "object"}})
    @action(detail=True, methods=["get"], pagination_class=CheckpointPagination)
    def events(self, request, pk=None):
        """The job's timeline: every decision (placement, failure class, restart, rollback, hang,
        straggler, quarantine) with its evidence, oldest first."""
        job = self.get_object()
        page = self.paginate_queryset(job.events.order_by("id"))
        return self.get_paginated_response([event_row(e) for e in page])

    @extend_schema(responses=CheckpointSerializer(many=True))
    @action(detail=True, methods=["get"], pagination_class=CheckpointPagination)
    def checkpoints(self, request, pk=None):
        job = self.get_object()
        page = self.paginate_queryset(job.checkpoints.order_by("-step", "-id"))
        return self.get_paginated_response(CheckpointSerializer(page, many=True).data)

    @extend_schema(request={"application/json": {"type": "object", "properties": {"checkpoint": {"type": "integer"}},
                                                 "required": ["checkpoint"]}},
                   responses={202: JobSerializer})
    @action(detail=True, methods=["post"])
    def rollback(self, request, pk=None):
        job = self.get_object()
        _require_staff(request, "roll a job back")
        data = request.data if isinstance(request.data, dict) else {}
        if "checkpoint" not in data:
            raise InvalidInput({"checkpoint": ["required: the id of the checkpoint to roll back to"]})
        job = services.job_rollback(job, user=request.user, checkpoint_id=data["checkpoint"])
        job = self.get_queryset().get(pk=job.pk)
        return Response(JobSerializer(job, context={"request": request}).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request={"application/json": {"type": "object", "properties": {"change": {
        "type": "object", "description": "optional: the recommendation's change as the caller saw it "
                                         "(409 if the profile recommends another one now)"}}}},
                   responses={202: JobSerializer})
    @action(detail=True, methods=["post"])
    def apply_recommendation(self, request, pk=None):
        """Restart the running job from its latest checkpoint with the spec change its profile
        recommends (the owner, their team, or staff: whoever may see the job)."""
        job = self.get_object()
        data = request.data if isinstance(request.data, dict) else {}
        change = data.get("change")
        if change is not None and not isinstance(change, dict):
            raise InvalidInput({"change": ["must be an object: the recommendation's change, e.g. "
                                           '{"comm.compression": "powersgd"}']})
        job = services.job_apply_recommendation(job, user=request.user, change=change)
        job = self.get_queryset().get(pk=job.pk)
        return Response(JobSerializer(job, context={"request": request}).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request={"application/json": {"type": "object", "properties": {"pinned": {"type": "boolean"}}}},
                   responses=CheckpointSerializer)
    @action(detail=True, methods=["post"], url_path=r"checkpoints/(?P<checkpoint_id>[0-9]+)/pin")
    def pin(self, request, pk=None, checkpoint_id=None):
        job = self.get_object()
        _require_staff(request, "pin checkpoints")
        checkpoint = job.checkpoints.filter(pk=int(checkpoint_id)).first()
        if checkpoint is None:
            raise NotFound({"checkpoint": [f"job {job.pk} has no checkpoint {checkpoint_id}"]})
        pinned = request.data.get("pinned", True) if isinstance(request.data, dict) else None
        if not isinstance(pinned, bool):
            raise InvalidInput({"pinned": ["must be true or false"]})
        checkpoint = services.checkpoint_pin(checkpoint, user=request.user, pinned=pinned)
        return Response(CheckpointSerializer(checkpoint).data)

    @extend_schema(parameters=[
        OpenApiParameter("attempt", int, description="attempt id (default: the latest attempt with kept logs)"),
        OpenApiParameter("rank", int, description="default 0"),
        OpenApiParameter("offset", int, description="first line, counted from the rank's first line (default 0)"),
        OpenApiParameter("limit", int, description=f"lines per page (default 1000, at most {MAX_LOG_LIMIT})"),
        OpenApiParameter("download", int, description="1: the whole kept file as text/plain")],
        responses={200: {"type": "object"}})
    @action(detail=True, methods=["get"], pagination_class=None)
    def logs(self, request, pk=None):
        """One rank's output in one attempt, kept after the job (under the kept log root), by pages
        of lines: {"attempt", "rank", "offset", "limit", "total", "next_offset", "lines": [...],
        "dropped_lines", "dropped_bytes", "note", "attempts": [{"id", "number", "ranks"}]}."""
        job = self.get_object()
        root = settings.TRAINYARD_KEPT_LOG_ROOT
        attempts = list(job.attempts.order_by("number").values_list("pk", "number"))
        index = keptlogs.kept_index(root, job.pk)
        attempt = _int_param(request, "attempt")
        if attempt is None:
            with_logs = [pk for pk, _ in attempts if pk in index]
            attempt = with_logs[-1] if with_logs else (attempts[-1][0] if attempts else None)
        elif attempt not in {pk for pk, _ in attempts}:
            raise InvalidInput({"attempt": [f"job {job.pk} has no attempt {attempt}"]})
        rank = _int_param(request, "rank", maximum=max(0, job.slots - 1), default=0)
        offset = _int_param(request, "offset", default=0)
        limit = _int_param(request, "limit", minimum=1, maximum=MAX_LOG_LIMIT, default=1000)
        download = request.query_params.get("download", "0")
        if download not in ("0", "1", "true", "false", ""):
            raise ValidationError({"download": [f"must be 1 or 0, got {echo(download)}"]})
        if download in ("1", "true"):
            return _log_download(root, job, attempt, rank)
        try:
            page = keptlogs.read_page(root, job.pk, attempt, rank, offset=offset, limit=limit)
        except UnsafePath:
            raise _unsafe_log(job, attempt, rank) from None
        cap = settings.TRAINYARD_LOG_MAX_BYTES_PER_JOB
        note = (f"the oldest {page['dropped_lines']} lines of this rank were cut: a job's kept logs are capped at "
                f"{cap} bytes (TRAINYARD_LOG_MAX_BYTES_PER_JOB)") if page["dropped_lines"] else ""
        return Response({"job": job.pk, "attempt": attempt, "rank": rank, **page, "max_bytes_per_job": cap,
                         "note": note, "attempts": [{"id": pk, "number": n, "ranks": index.get(pk, [])}
                                                    for pk, n in attempts]})


def _unsafe_log(job, attempt: int | None, rank: int) -> NotFound:
    return NotFound({"logs": [f"job {job.pk}'s kept log for attempt {attempt}, rank {rank} is not a regular file "
                              "(a symlink or another kind of file was found in its place and refused)"]})


def _log_download(root, job, attempt: int | None, rank: int):
    try:
        if attempt is None:  # the job never had an attempt
            raise FileNotFoundError
        f, dropped = keptlogs.open_kept(root, job.pk, attempt, rank)
    except FileNotFoundError:
        raise NotFound({"logs": [f"job {job.pk} has no kept log for attempt {attempt}, rank {rank}"]}) from None
    except UnsafePath:
        raise _unsafe_log(job, attempt, rank) from None
    response = FileResponse(f, as_attachment=True, filename=f"job-{job.pk}-attempt-{attempt}-rank-{rank}.log",
                            content_type="text/plain; charset=utf-8")
    response["X-Trainyard-Dropped-Lines"] = str(dropped["lines"])
    return response


class NodeViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = NodeSerializer
    queryset = Node.objects.all().order_by("name")
    lookup_field = "name"
    lookup_value_regex = "[^/]+"

    def get_object(self):
        name = self.kwargs["name"]
        # no node has a name with NUL (PostgreSQL's text refuses it: the lookup raised, a 500)
        node = None if text_problem(name) else self.get_queryset().filter(name=name).first()
        if node is None:
            raise NotFound({"node": [f"no node named {echo(self.kwargs['name'])}"]})
        return node

    def _schedulable(self, request, action: str):
        node = self.get_object()
        _require_staff(request, f"{action} nodes")
        mode = request.data.get("mode") if isinstance(request.data, dict) else None
        node = services.node_set_schedulable(node, user=request.user, action=action, mode=mode)
        return Response(NodeSerializer(node).data)

    @extend_schema(request={"application/json": {"type": "object", "properties": {
        "mode": {"type": "string", "enum": ["finish", "preempt"]}}, "required": ["mode"]}}, responses=NodeSerializer)
    @action(detail=True, methods=["post"])
    def drain(self, request, name=None):
        """No new work; running jobs finish ("finish") or checkpoint and move ("preempt") (staff)."""
        return self._schedulable(request, "drain")

    @extend_schema(request=None, responses=NodeSerializer)
    @action(detail=True, methods=["post"])
    def cordon(self, request, name=None):
        """No new work; running jobs continue (staff)."""
        return self._schedulable(request, "cordon")

    @extend_schema(request=None, responses=NodeSerializer)
    @action(detail=True, methods=["post"])
    def uncordon(self, request, name=None):
        """The node takes new work again (staff)."""
        return self._schedulable(request, "uncordon")

    @extend_schema(request=None, responses=NodeSerializer)
    @action(detail=True, methods=["post"])
    def clear(self, request, name=None):
        """Lift the node's quarantine (staff)."""
        node = self.get_object()
        _require_staff(request, "clear a quarantine")
        node = services.node_clear(node, user=request.user)
        return Response(NodeSerializer(node).data)


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
        _require_staff(request, "change quotas")
        services.quotas_update(actor=request.user, entries=request.data)
        return self.get(request)
