"""Bucketed series for charts (issue 25, section 2; jobs/telemetry/series.py):

GET /api/v1/jobs/<id>/series/?metric=loss&x=step|time&points=1500   one job's series
GET /api/v1/series/?jobs=1,2,3&metric=loss&x=step&points=1500         several jobs' (the compare and
                                                                       experiment pages)
GET /api/v1/series/metrics/?jobs=1,2,3                                the metric names they reported

Only jobs the user may see: one job's series answers 404 otherwise; a list leaves such ids out and
names them under `missing` (an id of no job and one of another team's job read the same). Bad
parameters are 400s naming the field. Parse, check access, call the selector, answer.
"""
from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView

from trainyard.textdoc import echo
from jobs.access import selectors as access_selectors
from jobs.core.errors import InvalidInput, NotFound
from jobs.core.http import int_param
from jobs.telemetry import series

# A request for more jobs than this is refused: 50 curves x 1,500 points is ~75k buckets, ~3 MB of JSON.
MAX_SERIES_JOBS = 50

_PARAMS = [
    OpenApiParameter("metric", str, required=True, description="a standard field (loss, step_s, ...) or a "
                     "user metric's name (run.log(step, val_loss=...))"),
    OpenApiParameter("x", str, enum=list(series.X_AXES), description="step (default) or time (the samples' "
                     "ts, epoch seconds)"),
    OpenApiParameter("points", int, description=f"at most this many buckets (1..{series.MAX_POINTS}, "
                     f"default {series.MAX_POINTS})"),
    OpenApiParameter("rank", int, description="one rank's samples only (default: every rank's)"),
]
_JOBS = OpenApiParameter("jobs", str, required=True,
                         description=f"comma-separated job ids, at most {MAX_SERIES_JOBS}")


def series_params(request) -> dict:
    """metric, x, max_points and rank from the query, or InvalidInput naming each bad one."""
    errors: dict[str, list[str]] = {}
    metric = request.query_params.get("metric", "")
    if not metric:
        errors["metric"] = ["required: a standard field such as loss, or the name of a metric the job logs"]
    elif not series.valid_metric_name(metric):
        errors["metric"] = [f"{echo(metric)} is not a metric name (letters, digits, _ . / -, at most 64, "
                            "starting with a letter or _)"]
    x = request.query_params.get("x") or "step"
    if x not in series.X_AXES:
        errors["x"] = [f"must be one of {', '.join(series.X_AXES)}, got {echo(x)}"]
    if errors:
        raise InvalidInput(errors)
    points = int_param(request, "points", minimum=1, maximum=series.MAX_POINTS, default=series.MAX_POINTS)
    rank = int_param(request, "rank")
    return {"metric": metric, "x": x, "max_points": points, "rank": rank}


def parse_job_ids(raw: str, *, cap: int = MAX_SERIES_JOBS) -> list[int]:
    """"3,7,9" as distinct ids in the order given (at most `cap`), or InvalidInput on field `jobs`
    (the compare page reads its ?jobs= with this too)."""
    if not raw.strip():
        raise InvalidInput({"jobs": ["required: comma-separated job ids, e.g. jobs=3,7"]})
    parts = [p.strip() for p in raw.split(",") if p.strip()]
    if len(parts) > cap:
        raise InvalidInput({"jobs": [f"at most {cap} jobs at a time, got {len(parts)}"]})
    ids: list[int] = []
    for p in parts:
        if not (p.isascii() and p.isdigit() and len(p) <= 18):
            raise InvalidInput({"jobs": [f"{echo(p)} is not a job id"]})
        if int(p) not in ids:
            ids.append(int(p))
    return ids


def job_ids_param(request) -> list[int]:
    return parse_job_ids(request.query_params.get("jobs", ""))


class JobSeriesView(APIView):
    @extend_schema(parameters=_PARAMS, responses={200: {"type": "object"}})
    def get(self, request, pk: int):
        """One metric of one job as at most `points` buckets {x, min, max, last}."""
        params = series_params(request)
        job = access_selectors.jobs_visible_to(request.user).filter(pk=pk).first()
        if job is None:
            raise NotFound(f"no job {pk} visible to you")
        data = series.job_series(job.pk, params["metric"], x=params["x"], max_points=params["max_points"],
                                 rank=params["rank"])
        return Response({"job": job.pk, "metric": params["metric"], "x": params["x"],
                         "points": params["max_points"], **data})


class SeriesView(APIView):
    @extend_schema(parameters=[_JOBS, *_PARAMS], responses={200: {"type": "object"}})
    def get(self, request):
        """One metric of several jobs, each as at most `points` buckets; `missing`: ids not visible."""
        params = series_params(request)
        ids = job_ids_param(request)
        jobs = {j.pk: j for j in access_selectors.jobs_visible_to(request.user).filter(pk__in=ids)}
        out = []
        for pk in ids:
            if pk in jobs:
                j = jobs[pk]
                data = series.job_series(pk, params["metric"], x=params["x"], max_points=params["max_points"],
                                         rank=params["rank"])
                out.append({"job": pk, "name": j.name, "status": j.status, **data})
        return Response({"metric": params["metric"], "x": params["x"], "points": params["max_points"],
                         "series": out, "missing": [pk for pk in ids if pk not in jobs]})


class SeriesMetricsView(APIView):
    @extend_schema(parameters=[_JOBS], responses={200: {"type": "object"}})
    def get(self, request):
        """The metric names the jobs reported: `metrics` (their union, sorted), `jobs` ({id: names})
        and `missing` (ids not visible)."""
        ids = job_ids_param(request)
        visible = set(access_selectors.jobs_visible_to(request.user).filter(pk__in=ids).values_list("pk", flat=True))
        names = series.job_metric_names([pk for pk in ids if pk in visible])
        union = sorted(set().union(*names.values())) if names else []
        return Response({"metrics": union, "jobs": {str(pk): v for pk, v in names.items()},
                         "missing": [pk for pk in ids if pk not in visible]})
