"""REST API under /api/v1/ (DESIGN.md section 4). Thin: parse, check access, call one service."""
from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, extend_schema
from django.conf import settings
from django.utils import timezone
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.pagination import PageNumberPagination
from rest_framework.response import Response
from rest_framework.views import APIView

from . import selectors, services
from .models import Attempt, Checkpoint, Job, MetricSample, Node
from .policy import diagnosis
from trainyard.spec import SpecError

MAX_METRICS_LIMIT = 10_000


class AttemptSerializer(serializers.ModelSerializer):
    ranks = serializers.SerializerMethodField()

    class Meta:
        model = Attempt
        fields = ["id", "number", "status", "outcome", "resumed_from", "resumed_from_step", "stop_reason", "failure",
                  "last_step", "last_progress_at", "stragglers", "created_at", "started_at", "ended_at", "ranks"]

    def get_ranks(self, obj) -> list[dict]:
        return selectors.attempt_rank_rows(obj)


class JobSerializer(serializers.ModelSerializer):
    owner = serializers.CharField(source="owner.username", read_only=True)
    total_steps = serializers.IntegerField(read_only=True)
    queue_position = serializers.SerializerMethodField()
    predicted_start_at = serializers.SerializerMethodField()
    attempts = AttemptSerializer(many=True, read_only=True)
    stragglers = serializers.SerializerMethodField()
    health = serializers.SerializerMethodField()

    class Meta:
        model = Job
        fields = ["id", "name", "status", "status_reason", "owner", "spec", "plan", "step", "total_steps",
                  "priority", "restarts", "created_at", "started_at", "finished_at", "queue_position",
                  "predicted_start_at", "predicted_s", "borrowing", "avoid_nodes", "stragglers", "health", "attempts"]

    def _current(self, obj) -> Attempt | None:
        attempts = sorted(obj.attempts.all(), key=lambda a: a.number)  # prefetched: no query
        return attempts[-1] if attempts else None

    def get_stragglers(self, obj) -> list[dict]:
        a = self._current(obj)
        return list(a.stragglers) if a is not None and a.status != Attempt.Status.ENDED else []

    def get_health(self, obj) -> dict:
        """What the hang detector sees for the running attempt."""
        a = self._current(obj)
        if a is None or a.status != Attempt.Status.RUNNING:
            return {"last_progress_at": None, "hang_timeout_s": None, "hang_timeout_source": None}
        recent = selectors.attempt_recent_samples(a.pk, a.last_step)
        timeout, source = diagnosis.hang_timeout(obj.spec.get("hang_timeout_s", "auto"),
                                                 [s["step_s"] for s in recent if s["step_s"] is not None],
                                                 settings.TRAINYARD_HANG_FLOOR_S)
        return {"last_progress_at": a.last_progress_at and timezone.localtime(a.last_progress_at).isoformat(),
                "hang_timeout_s": round(timeout, 1), "hang_timeout_source": source}

    def get_queue_position(self, obj) -> int | None:
        positions = self.context.get("queue_positions")
        if positions is None:
            positions = self.context["queue_positions"] = selectors.queue_positions()
        return positions.get(obj.pk)

    def get_predicted_start_at(self, obj) -> str | None:
        if obj.status != Job.Status.QUEUED or obj.predicted_start_at is None:
            return None
        return timezone.localtime(obj.predicted_start_at).isoformat()


class MetricSerializer(serializers.ModelSerializer):
    attempt = serializers.IntegerField(source="attempt_id")

    class Meta:
        model = MetricSample
        fields = list(MetricSample.FIELDS) + ["attempt"]


class CheckpointSerializer(serializers.ModelSerializer):
    attempt = serializers.IntegerField(source="attempt_id", allow_null=True)
    deleted = serializers.SerializerMethodField()

    class Meta:
        model = Checkpoint
        fields = ["id", "step", "attempt", "created_at", "size_bytes", "blocking_s", "save_s", "superseded",
                  "pinned", "deleted", "deleted_at", "path"]

    def get_deleted(self, obj) -> bool:
        return obj.deleted_at is not None


class CheckpointPagination(PageNumberPagination):  # also the events timeline
    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 500


class NodeSerializer(serializers.ModelSerializer):
    slots_used = serializers.SerializerMethodField()

    class Meta:
        model = Node
        fields = ["name", "status", "slots", "slots_used", "address", "labels", "devices", "cpu_percent",
                  "mem_percent", "last_heartbeat", "quarantined_at", "quarantine_reason", "drain_mode"]

    def get_slots_used(self, obj) -> int:
        used = self.context.get("slots_used")
        if used is None:
            used = self.context["slots_used"] = selectors.slots_used_by_node()
        return used.get(obj.pk, 0)


def _forbidden(message: str) -> Response:
    return Response({"errors": {"detail": [message]}}, status=status.HTTP_403_FORBIDDEN)


def _int_param(request, name: str, *, minimum: int = 0, maximum: int | None = None, default=None):
    raw = request.query_params.get(name)
    if raw in (None, ""):
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValidationError({name: [f"must be an integer, got {raw!r}"]}) from None
    if value < minimum or (maximum is not None and value > maximum):
        raise ValidationError({name: [f"must be between {minimum} and {maximum}" if maximum is not None
                                      else f"must be at least {minimum}"]})
    return value


class JobViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = JobSerializer

    def get_queryset(self):
        return selectors.jobs_visible_to(self.request.user).prefetch_related(
            "attempts__allocations__node").order_by("-id")

    @extend_schema(request={"application/json": {"type": "object", "description": "JobSpec (DESIGN.md)"}},
                   responses={201: JobSerializer})
    def create(self, request):
        if not isinstance(request.data, dict):
            raise ValidationError({"spec": ["send the JobSpec as a JSON object"]})
        try:
            job = services.job_submit(request.user, dict(request.data))
        except SpecError as exc:
            return Response({"errors": exc.errors}, status=status.HTTP_400_BAD_REQUEST)
        return Response(JobSerializer(job, context={"request": request}).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={202: JobSerializer})
    @action(detail=True, methods=["post"])
    def cancel(self, request, pk=None):
        job = self.get_object()
        if not (request.user.is_staff or job.owner_id == request.user.pk):
            return Response({"errors": {"detail": ["only the job's owner or staff may cancel it"]}},
                            status=status.HTTP_403_FORBIDDEN)
        try:
            job = services.job_cancel(request.user, job)
        except services.TransitionError as exc:
            return Response({"errors": {"status": [str(exc)]}}, status=status.HTTP_409_CONFLICT)
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
        return self.get_paginated_response([selectors.event_dict(e) for e in page])

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
        if not request.user.is_staff:
            return _forbidden("only staff may roll a job back")
        data = request.data if isinstance(request.data, dict) else {}
        if "checkpoint" not in data:
            return Response({"errors": {"checkpoint": ["required: the id of the checkpoint to roll back to"]}},
                            status=status.HTTP_400_BAD_REQUEST)
        try:
            job = services.job_rollback(request.user, job, data["checkpoint"])
        except SpecError as exc:
            return Response({"errors": exc.errors}, status=status.HTTP_400_BAD_REQUEST)
        except services.TransitionError as exc:
            return Response({"errors": {"status": [str(exc)]}}, status=status.HTTP_409_CONFLICT)
        job = self.get_queryset().get(pk=job.pk)
        return Response(JobSerializer(job, context={"request": request}).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request={"application/json": {"type": "object", "properties": {"pinned": {"type": "boolean"}}}},
                   responses=CheckpointSerializer)
    @action(detail=True, methods=["post"], url_path=r"checkpoints/(?P<checkpoint_id>[0-9]+)/pin")
    def pin(self, request, pk=None, checkpoint_id=None):
        job = self.get_object()
        if not request.user.is_staff:
            return _forbidden("only staff may pin checkpoints")
        checkpoint = job.checkpoints.filter(pk=int(checkpoint_id)).first()
        if checkpoint is None:
            return Response({"errors": {"checkpoint": [f"job {job.pk} has no checkpoint {checkpoint_id}"]}},
                            status=status.HTTP_404_NOT_FOUND)
        pinned = request.data.get("pinned", True) if isinstance(request.data, dict) else None
        if not isinstance(pinned, bool):
            return Response({"errors": {"pinned": ["must be true or false"]}}, status=status.HTTP_400_BAD_REQUEST)
        try:
            checkpoint = services.checkpoint_pin(request.user, checkpoint, pinned)
        except services.TransitionError as exc:
            return Response({"errors": {"checkpoint": [str(exc)]}}, status=status.HTTP_409_CONFLICT)
        return Response(CheckpointSerializer(checkpoint).data)

    @extend_schema(parameters=[OpenApiParameter("rank", int), OpenApiParameter("limit", int)])
    @action(detail=True, methods=["get"], pagination_class=None)
    def logs(self, request, pk=None):
        job = self.get_object()
        rank = _int_param(request, "rank")
        limit = _int_param(request, "limit", minimum=1, maximum=5000, default=500)
        return Response(selectors.job_log_lines(job.pk, rank=rank, limit=limit))


class NodeViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = NodeSerializer
    queryset = Node.objects.all().order_by("name")
    lookup_field = "name"
    lookup_value_regex = "[^/]+"

    def get_object(self):
        node = self.get_queryset().filter(name=self.kwargs["name"]).first()
        if node is None:
            raise NotFound({"node": [f"no node named {self.kwargs['name']!r}"]})
        return node

    def _schedulable(self, request, action: str):
        node = self.get_object()
        if not request.user.is_staff:
            return _forbidden(f"only staff may {action} nodes")
        mode = request.data.get("mode") if isinstance(request.data, dict) else None
        try:
            node = services.node_set_schedulable(request.user, node, action, mode)
        except SpecError as exc:
            return Response({"errors": exc.errors}, status=status.HTTP_400_BAD_REQUEST)
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
        if not request.user.is_staff:
            return _forbidden("only staff may clear a quarantine")
        node = services.node_clear(request.user, node)
        return Response(NodeSerializer(node).data)


class QuotaView(APIView):
    """GET: every team's (and quota'd user's) quota, in use, borrowed, queued demand and device-hours
    used in the rolling window. PUT (staff): one quota object or a list; all or nothing; takes
    effect at the next scheduling tick and lands in the quota audit log."""

    @extend_schema(responses={200: {"type": "object"}})
    def get(self, request):
        rows = selectors.quota_table()
        return Response({"count": len(rows), "next": None, "previous": None, "results": rows})

    @extend_schema(request={"application/json": {"type": "array", "items": {"type": "object", "properties": {
        "team": {"type": "string"}, "user": {"type": "string"}, "max_slots": {"type": "integer"},
        "device_hours": {"type": "number", "nullable": True}}}}}, responses={200: {"type": "object"}})
    def put(self, request):
        if not request.user.is_staff:
            return _forbidden("only staff may change quotas")
        try:
            services.quotas_update(request.user, request.data)
        except SpecError as exc:
            return Response({"errors": exc.errors}, status=status.HTTP_400_BAD_REQUEST)
        return self.get(request)
