"""The jobs API under /api/v1/jobs/: submit, list, detail, cancel, rollback, apply a recommendation, checkpoints, metrics, events, kept logs. Parse, check access, call one service, serialize.
"""
from __future__ import annotations
from django.conf import settings
from django.http import FileResponse
from drf_spectacular.utils import OpenApiParameter, PolymorphicProxySerializer, extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.pagination import PageNumberPagination
from rest_framework.response import Response
from trainyard.safefs import UnsafePath
from trainyard.textdoc import echo
from jobs.core.http import int_param, require_staff
from jobs.telemetry import keptlogs, selectors as telemetry_selectors
from jobs.access import selectors as access_selectors
from jobs.attempts.services import checkpoints as attempts_services_checkpoints, rollback as attempts_services_rollback
from jobs.runs import selectors as runs_selectors, services
from jobs.core.errors import Forbidden, InvalidInput, NotFound
from jobs.attempts.rows import event_row
from jobs.runs.serializers import CheckpointSerializer, JobSerializer, JobSubmittedSerializer
from jobs.telemetry.serializers import MetricSerializer, MetricStepSerializer
from jobs.core.throttles import SubmitThrottle


MAX_METRICS_LIMIT = 10_000


MAX_LOG_LIMIT = 5000


class CheckpointPagination(PageNumberPagination):  # also the events timeline
    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 500


class JobListPagination(PageNumberPagination):
    page_size = 50  # the API's default page (REST_FRAMEWORK PAGE_SIZE), as before filters came
    page_size_query_param = "page_size"
    max_page_size = 500

    def paginate_queryset(self, queryset, request, view=None):
        # pages over the ids alone, then fetches the page's rows (runs_selectors.page_ids: the sort
        # of a deep page moves ids, not specs)
        ids = super().paginate_queryset(runs_selectors.page_ids(queryset), request, view)
        return None if ids is None else runs_selectors.page_rows(queryset, ids)


_LIST_PARAMETERS = [
    *(OpenApiParameter(f.name, str, many=f.name in ("status", "owner", "team", "node", "tag"), description=f.help)
      for f in runs_selectors.FILTERS),
    OpenApiParameter("q", str, description="name contains (case-insensitive)"),
    OpenApiParameter("ordering", str, description=f"one of {', '.join(runs_selectors.ORDERINGS)}; a leading - "
                                                  f"for descending (default {runs_selectors.DEFAULT_ORDERING})"),
]
_EDIT_FIELDS = {"tags", "note", "tags_add", "tags_remove"}


class JobViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = JobSerializer
    pagination_class = JobListPagination

    def get_throttles(self):
        # a submission counts against the stricter submit rate as well as the user's own
        return [*super().get_throttles(), *([SubmitThrottle()] if self.action == "create" else [])]

    def get_queryset(self):
        if self.action == "list":  # filters, search and ordering (jobs/runs/selectors.py; 400 naming a bad one)
            jobs = runs_selectors.jobs_listed(self.request.user, runs_selectors.job_query(self.request.query_params))
        else:
            jobs = access_selectors.jobs_visible_to(self.request.user).prefetch_related("tags").order_by("-id")
        return jobs.select_related("trial").prefetch_related(
            "attempts__allocations__node", "attempts__slurm__pool").annotate(
            has_telemetry=telemetry_selectors.has_telemetry_expr())

    @extend_schema(parameters=_LIST_PARAMETERS)
    def list(self, request, *args, **kwargs):
        """The jobs you can see (yours, your teams'; staff: all), filtered, searched and ordered
        by the query parameters, a page at a time (`page`, `page_size` up to 500)."""
        return super().list(request, *args, **kwargs)

    @extend_schema(request={"application/json": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string"}, "description": "the whole new set"},
        "tags_add": {"type": "array", "items": {"type": "string"}},
        "tags_remove": {"type": "array", "items": {"type": "string"}},
        "note": {"type": "string"}}}}, responses={200: JobSerializer})
    def partial_update(self, request, pk=None):
        """Edit a job's tags and note (its owner, their team, staff): `tags` replaces the set, or
        `tags_add`/`tags_remove` change it; `note` replaces the note. One "annotated" event."""
        job = self.get_object()
        data = request.data
        if not isinstance(data, dict) or not data:
            raise InvalidInput({"body": [f"send a JSON object with any of {', '.join(sorted(_EDIT_FIELDS))}"]})
        unknown = sorted(set(data) - _EDIT_FIELDS)
        if unknown:
            raise InvalidInput({k: [f"not editable: only {', '.join(sorted(_EDIT_FIELDS))}"] for k in unknown[:10]})
        services.job_annotate(job, user=request.user, tags=data.get("tags"), add=data.get("tags_add") or (),
                              remove=data.get("tags_remove") or (), note=data.get("note"))
        return Response(JobSerializer(self.get_queryset().get(pk=job.pk), context={"request": request}).data)

    @extend_schema(request={"application/json": {"type": "object", "description": "JobSpec (docs/architecture.md, section 7)"}},
                   responses={201: JobSubmittedSerializer})
    def create(self, request):
        if not isinstance(request.data, dict):
            raise ValidationError({"spec": ["send the JobSpec as a JSON object"]})
        job = services.job_submit(user=request.user, spec=services.submitted_spec(dict(request.data)))
        return Response(JobSubmittedSerializer(job, context={"request": request}).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={202: JobSerializer})
    @action(detail=True, methods=["post"])
    def cancel(self, request, pk=None):
        job = self.get_object()
        if not (request.user.is_staff or job.owner_id == request.user.pk):
            raise Forbidden("only the job's owner or staff may cancel it")
        job = services.job_cancel(job, user=request.user)
        return Response(JobSerializer(job, context={"request": request}).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(parameters=[OpenApiParameter("since_step", int),
                               OpenApiParameter("rank", int, description="that rank's own samples (MetricSample "
                                                "rows: kept for a recent window of steps, thinned before it)"),
                               OpenApiParameter("per_rank", bool, description="every rank's own samples (one row "
                                                "per rank and step, as rank= gives one rank's)"),
                               OpenApiParameter("limit", int),
                               OpenApiParameter("attempt", int, description="one attempt's own rows; by default "
                                                "each step once, as the charts show it after restarts/rollbacks")],
                   responses={200: PolymorphicProxySerializer(
                       component_name="MetricRow", serializers=[MetricStepSerializer, MetricSerializer],
                       resource_type_field_name=None, many=True)})
    @action(detail=True, methods=["get"], pagination_class=None)
    def metrics(self, request, pk=None):
        """The job's metrics, a plain list. By default one row per step along the job's lineage, every
        rank reduced and kept for the job's life (`MetricStep`: each standard field under its sample
        name is the mean over the ranks that reported it, with `<field>_min`, `_max`, `_n`; `rank` is
        null, `ranks` counts them). With `rank=N` that rank's own samples, with `per_rank=true` every
        rank's (`Metric`: one row per rank and step): the drill-down, kept for a recent window of
        steps (2,000 by default) and thinned before it."""
        job = self.get_object()
        per_rank = request.query_params.get("per_rank", "")
        if per_rank not in ("", "0", "1", "true", "false"):
            raise InvalidInput({"per_rank": ["must be true or false"]})
        rank = int_param(request, "rank")
        per_rank = per_rank in ("1", "true") or rank is not None
        rows = telemetry_selectors.job_metrics(
            job, since_step=int_param(request, "since_step"), rank=rank, per_rank=per_rank,
            limit=int_param(request, "limit", minimum=1, maximum=MAX_METRICS_LIMIT, default=1000),
            attempt=int_param(request, "attempt"))
        return Response((MetricSerializer if per_rank else MetricStepSerializer)(rows, many=True).data)

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
        require_staff(request, "roll a job back")
        data = request.data if isinstance(request.data, dict) else {}
        if "checkpoint" not in data:
            raise InvalidInput({"checkpoint": ["required: the id of the checkpoint to roll back to"]})
        job = attempts_services_rollback.job_rollback(job, user=request.user, checkpoint_id=data["checkpoint"])
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
        require_staff(request, "pin checkpoints")
        checkpoint = job.checkpoints.filter(pk=int(checkpoint_id)).first()
        if checkpoint is None:
            raise NotFound({"checkpoint": [f"job {job.pk} has no checkpoint {checkpoint_id}"]})
        pinned = request.data.get("pinned", True) if isinstance(request.data, dict) else None
        if not isinstance(pinned, bool):
            raise InvalidInput({"pinned": ["must be true or false"]})
        checkpoint = attempts_services_checkpoints.checkpoint_pin(checkpoint, user=request.user, pinned=pinned)
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
        attempt = int_param(request, "attempt")
        if attempt is None:
            with_logs = [pk for pk, _ in attempts if pk in index]
            attempt = with_logs[-1] if with_logs else (attempts[-1][0] if attempts else None)
        elif attempt not in {pk for pk, _ in attempts}:
            raise InvalidInput({"attempt": [f"job {job.pk} has no attempt {attempt}"]})
        rank = int_param(request, "rank", maximum=max(0, job.slots - 1), default=0)
        offset = int_param(request, "offset", default=0)
        limit = int_param(request, "limit", minimum=1, maximum=MAX_LOG_LIMIT, default=1000)
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
