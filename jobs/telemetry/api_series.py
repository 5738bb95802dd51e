"""Bucketed series for charts (issue 25, section 2; jobs/telemetry/series.py):

GET /api/v1/jobs/<id>/series/?metric=loss&x=step|time&buckets=1500&rank=   one job's series
GET /api/v1/series/?jobs=1,2,3&metric=loss&x=step&buckets=1500         several jobs' (the compare and
                                                                        experiment pages)
GET /api/v1/series/metrics/?jobs=1,2,3                                 the metric names they reported
GET /api/v1/jobs/<id>/ranks/?metric=step_s&steps=2000&buckets=1500     how its ranks spread (issue 26)

Series read the per-step rows (MetricStep: every rank reduced, kept for the job's life); `rank=`
reads that rank's own samples (kept for a recent window: retention). `buckets` is the number of
buckets (`points`, its older name, still works; `buckets` wins when both are given).

Only jobs the user may see: one job's series answers 404 otherwise; a list leaves such ids out and
names them under `missing` (an id of no job and one of another team's job read the same). Bad
parameters are 400s naming the field. Parse, check access, call the selector, answer.
"""
from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView

from trainyard.textdoc import echo, whole_number
from jobs.access import selectors as access_selectors
from jobs.core.errors import InvalidInput, NotFound
from jobs.core.http import int_param
from jobs.telemetry import series

# A request for more jobs than this is refused: 50 curves x 1,500 points is ~75k buckets, ~3 MB of JSON.
MAX_SERIES_JOBS = 50
MAX_RANKS_TOP = 100  # ranks named as slowest / fastest at most

_PARAMS = [
    OpenApiParameter("metric", str, required=True, description="a standard field (loss, step_s, ...) or a "
                     "user metric's name (run.log(step, val_loss=...))"),
    OpenApiParameter("x", str, enum=list(series.X_AXES), description="step (default) or time (the samples' "
                     "ts, epoch seconds)"),
    OpenApiParameter("buckets", int, description=f"at most this many buckets (1..{series.MAX_POINTS}, "
                     f"default {series.MAX_POINTS})"),
    OpenApiParameter("points", int, description="the older name of `buckets` (`buckets` wins when both are given)"),
    OpenApiParameter("rank", int, description="one rank's own samples (MetricSample: kept for a recent window "
                     "of steps, thinned before it); default: the per-step rows, every rank reduced (min and max "
                     "over ranks, last = the mean over ranks at the bucket's last step)"),
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
    rank = int_param(request, "rank")
    return {"metric": metric, "x": x, "max_points": buckets_param(request), "rank": rank}


def buckets_param(request) -> int:
    """`buckets` (or its older name `points`): 1..MAX_POINTS, default MAX_POINTS."""
    name = "buckets" if request.query_params.get("buckets") not in (None, "") else "points"
    return int_param(request, name, minimum=1, maximum=series.MAX_POINTS, default=series.MAX_POINTS)


def ranks_params(request) -> dict:
    """metric (one of RANKED_FIELDS), steps, max_points and top from the query, or InvalidInput."""
    metric = request.query_params.get("metric") or "step_s"
    if metric not in series.RANKED_FIELDS:
        raise InvalidInput({"metric": [f"must be one of {', '.join(series.RANKED_FIELDS)} (the fields whose "
                                       f"slowest and fastest ranks are kept), got {echo(metric)}"]})
    steps = int_param(request, "steps", minimum=1, maximum=series.MAX_RANK_WINDOW_STEPS,
                      default=series.RANK_WINDOW_STEPS)
    top = int_param(request, "top", minimum=1, maximum=MAX_RANKS_TOP, default=series.RANKS_LISTED)
    return {"metric": metric, "steps": steps, "max_points": buckets_param(request), "top": top}


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
        if (job_id := whole_number(p)) is None:
            raise InvalidInput({"jobs": [f"{echo(p)} is not a job id"]})
        if job_id not in ids:
            ids.append(job_id)
    return ids


def job_ids_param(request) -> list[int]:
    return parse_job_ids(request.query_params.get("jobs", ""))


class JobSeriesView(APIView):
    @extend_schema(parameters=_PARAMS, responses={200: {"type": "object"}})
    def get(self, request, pk: int):
        """One metric of one job as at most `buckets` buckets {x, min, max, last} (`points` in the
        answer: that number)."""
        params = series_params(request)
        job = access_selectors.jobs_visible_to(request.user).filter(pk=pk).first()
        if job is None:
            raise NotFound(f"no job {pk} visible to you")
        data = series.job_series(job.pk, params["metric"], x=params["x"], max_points=params["max_points"],
                                 rank=params["rank"])
        return Response({"job": job.pk, "metric": params["metric"], "x": params["x"],
                         "points": params["max_points"], **data})


_RANK_PARAMS = [
    OpenApiParameter("metric", str, enum=list(series.RANKED_FIELDS),
                     description="a field whose slowest and fastest ranks the relay keeps (default step_s)"),
    OpenApiParameter("steps", int, description=f"the window: the job's last this many steps (1.."
                     f"{series.MAX_RANK_WINDOW_STEPS}, default {series.RANK_WINDOW_STEPS}: the per-rank rows "
                     "kept at full resolution)"),
    OpenApiParameter("buckets", int, description=f"at most this many band buckets (1..{series.MAX_POINTS}, "
                     f"default {series.MAX_POINTS}); `points` is accepted too"),
    OpenApiParameter("top", int, description=f"how many slowest and fastest ranks to name (1..{MAX_RANKS_TOP}, "
                     f"default {series.RANKS_LISTED})"),
]


class JobRanksView(APIView):
    @extend_schema(parameters=_RANK_PARAMS, responses={200: {"type": "object"}})
    def get(self, request, pk: int):
        """How a job's ranks spread over its last `steps` steps: `band` (per bucket {x, min, mean, max}
        across ranks, from the per-step rows; the centre is the mean, because a median is not
        mergeable across relay rounds), `slowest` and `fastest` (the ranks most often the step's
        highest / lowest value, each {rank, steps, share, mean}: `mean` is the rank's own mean over
        the window from its per-rank samples, null when retention kept none) and `window`
        ({from, to, steps})."""
        params = ranks_params(request)
        job = access_selectors.jobs_visible_to(request.user).filter(pk=pk).first()
        if job is None:
            raise NotFound(f"no job {pk} visible to you")
        data = series.job_rank_view(job.pk, params["metric"], steps=params["steps"],
                                    max_points=params["max_points"], top=params["top"])
        return Response({"job": job.pk, "metric": params["metric"], "steps": params["steps"],
                         "points": params["max_points"], **data})


class SeriesView(APIView):
    @extend_schema(parameters=[_JOBS, *_PARAMS], responses={200: {"type": "object"}})
    def get(self, request):
        """One metric of several jobs, each as at most `buckets` buckets; `missing`: ids not visible."""
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
