"""The job list's query, one for the page (/jobs/), the API (GET /api/v1/jobs/) and the CLI (`ls`):
filters, name search and ordering parsed from query parameters once (`job_query`, InvalidInput with
a message per bad parameter), applied to the jobs the user may see (`jobs_listed`).

Each filter is one entry of FILTERS: its query-parameter name, how its values parse, and how it
narrows the queryset. A new filter (the experiments domain's `experiment`) is one more entry; the
page's form, the API's schema and the CLI pick it up by name.

Multi-valued parameters come repeated (`?tag=a&tag=b`) or as one comma list (`?tag=a,b`); empty
values (a form's blank select) are ignored. Values of one filter are OR'ed (`status=QUEUED,RUNNING`),
except tags, which are AND'ed (`tag=lr-sweep,baseline`: jobs carrying both), and filters are AND'ed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, time, timedelta
from typing import Any, Callable

from django.db.models import Exists, F, OuterRef, QuerySet
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime

from jobs.access import selectors as access_selectors
from jobs.core.dbtext import text_problem
from jobs.core.errors import InvalidInput
from jobs.models import Allocation, Job, JobTag
from trainyard.tags import MAX_TAGS, tag_problem
from trainyard.textdoc import echo, whole_number

MAX_VALUES = 50  # values of one filter (a comma list of 10,000 statuses is a mistake, not a query)
MAX_SEARCH_CHARS = 200
MAX_NAME_CHARS = 150  # a username or team name (Django's limits) or a node name


class _Bad(ValueError):
    """One parameter's problem (the message is the whole sentence)."""


def _values(raw: list[str]) -> list[str]:
    out = [v.strip() for part in raw for v in part.split(",") if v.strip()]
    if why := next(filter(None, map(text_problem, out)), None):  # the HTTP edge refuses these first
        raise _Bad(f"a value {why}")
    if len(out) > MAX_VALUES:
        raise _Bad(f"at most {MAX_VALUES} values, got {len(out)}")
    return list(dict.fromkeys(out))


def _statuses(raw: list[str]) -> list[str]:
    values = [v.upper() for v in _values(raw)]
    bad = [v for v in values if v not in Job.Status.values]
    if bad:
        raise _Bad(f"{echo(bad[0])} is not a job status: one of {', '.join(Job.Status.values)}")
    return values


def _names(raw: list[str]) -> list[str]:
    values = _values(raw)
    if any(len(v) > MAX_NAME_CHARS for v in values):
        raise _Bad(f"a name is at most {MAX_NAME_CHARS} characters")
    return values


def _tags(raw: list[str]) -> list[str]:
    values = [v.lower() for v in _values(raw)]
    problems = [p for p in map(tag_problem, values) if p]
    if problems:
        raise _Bad(problems[0])
    if len(values) > MAX_TAGS:
        raise _Bad(f"at most {MAX_TAGS} tags (a job has at most {MAX_TAGS})")
    return values


def _ids(raw: list[str]) -> list[int]:
    values = _values(raw)
    ids = [whole_number(v) for v in values]
    if None in ids:
        raise _Bad(f"{echo(values[ids.index(None)])} is not an experiment id (a positive whole number)")
    return ids


def _when(raw: list[str], *, end_of_day: bool) -> datetime:
    values = _values(raw)
    if len(values) != 1:
        raise _Bad("one date or time, e.g. 2026-12-06 or 2026-12-06T14:30")
    text = values[0]
    try:
        moment = parse_datetime(text) if len(text) > 10 else None
        day = parse_date(text) if moment is None else None
    except ValueError:  # well formed but impossible: 2026-02-30
        moment = day = None
    if moment is None and day is None:
        raise _Bad(f"{echo(text)} is not a date or time: write 2026-12-06 or 2026-12-06T14:30 (ISO 8601)")
    if moment is None:  # a whole day: from its start, or (until) to its end
        moment = datetime.combine(day + timedelta(days=1) if end_of_day else day, time())
    return timezone.make_aware(moment) if timezone.is_naive(moment) else moment


def _since(raw: list[str]) -> datetime:
    return _when(raw, end_of_day=False)


def _until(raw: list[str]) -> datetime:
    return _when(raw, end_of_day=True)


def _on_node(qs: QuerySet, names: list[str]) -> QuerySet:
    # Any attempt of the job ran (or runs) on one of the nodes: a semi-join on the allocations, so a
    # job with many attempts there is still one row.
    return qs.filter(Exists(Allocation.objects.filter(attempt__job=OuterRef("pk"), node__name__in=names)))


def _with_tags(qs: QuerySet, tags: list[str]) -> QuerySet:
    for tag in tags:  # every tag: one indexed semi-join each (jobtag_name_job_idx)
        qs = qs.filter(Exists(JobTag.objects.filter(job=OuterRef("pk"), name=tag)))
    return qs


@dataclass(frozen=True)
class ListFilter:
    """One filter of the job list: `?<name>=...` parsed by `parse` (raising _Bad) and applied by `apply`."""

    name: str
    parse: Callable[[list[str]], Any]
    apply: Callable[[QuerySet, Any], QuerySet]
    help: str


FILTERS: tuple[ListFilter, ...] = (
    ListFilter("status", _statuses, lambda qs, v: qs.filter(status__in=v),
               "job status (QUEUED, RUNNING, ...; repeat or comma list: any of them)"),
    ListFilter("owner", _names, lambda qs, v: qs.filter(owner__username__in=v), "owner's username (any of them)"),
    ListFilter("team", _names, lambda qs, v: qs.filter(team__name__in=v), "team name (any of them)"),
    ListFilter("node", _names, _on_node, "ran on this node in any attempt (any of them)"),
    ListFilter("tag", _tags, _with_tags, "carries this tag (repeat or comma list: all of them)"),
    ListFilter("since", _since, lambda qs, v: qs.filter(created_at__gte=v),
               "submitted at or after (ISO 8601 date or time; a date: from its start)"),
    ListFilter("until", _until, lambda qs, v: qs.filter(created_at__lt=v),
               "submitted before (ISO 8601; a date: to its end, inclusive)"),
    ListFilter("experiment", _ids, lambda qs, v: qs.filter(trial__experiment_id__in=v),
               "a trial of this experiment (its id; any of them)"),
)

# ?ordering=<key> ascending, -<key> descending; id breaks ties so pages never overlap or skip a job.
ORDERINGS: dict[str, str] = {"id": "id", "name": "name", "status": "status", "owner": "owner__username",
                             "submitted": "created_at", "started": "started_at", "finished": "finished_at",
                             "steps": "step"}
DEFAULT_ORDERING = "-id"  # newest first, as the list always was


@dataclass(frozen=True)
class JobQuery:
    """A parsed job-list query: filter name -> parsed value (only those given), the name search
    (case-insensitive substring), and the ordering key ("-submitted")."""

    filters: dict[str, Any] = field(default_factory=dict)
    q: str = ""
    ordering: str = DEFAULT_ORDERING

    def is_filtered(self) -> bool:
        return bool(self.filters or self.q)


def job_query(params) -> JobQuery:
    """The JobQuery in `params` (a QueryDict, or any mapping of name -> str or list of str), or
    InvalidInput naming each bad parameter. Unknown parameters are left to the caller (the page
    and the API have their own: page, page_size)."""
    def getlist(name: str) -> list[str]:
        if hasattr(params, "getlist"):
            return params.getlist(name)
        v = params.get(name)
        return [] if v is None else [v] if isinstance(v, str) else list(v)

    errors: dict[str, list[str]] = {}
    filters: dict[str, Any] = {}
    for f in FILTERS:
        raw = [str(v) for v in getlist(f.name)]
        if not any(v.strip(" ,") for v in raw):
            continue
        try:
            filters[f.name] = f.parse(raw)
        except _Bad as exc:
            errors[f.name] = [str(exc)]
    if "since" in filters and "until" in filters and filters["since"] >= filters["until"]:
        errors["until"] = ["must be later than since"]
    q = " ".join(getlist("q")).strip()
    if len(q) > MAX_SEARCH_CHARS:
        errors["q"] = [f"at most {MAX_SEARCH_CHARS} characters"]
    elif why := text_problem(q):
        errors["q"] = [f"the search {why}"]
    ordering = (getlist("ordering") or [""])[-1].strip() or DEFAULT_ORDERING
    if ordering.removeprefix("-") not in ORDERINGS:
        errors["ordering"] = [f"{echo(ordering)} is not a column to sort by: one of "
                              f"{', '.join(ORDERINGS)}, with a leading - for descending"]
    if errors:
        raise InvalidInput(errors)
    return JobQuery(filters=filters, q=q, ordering=ordering)


def order_by(qs: QuerySet, ordering: str) -> QuerySet:
    desc = ordering.startswith("-")
    column = ORDERINGS[ordering.removeprefix("-")]
    if column == "id":
        return qs.order_by("-id" if desc else "id")
    # jobs not yet started or finished sort last either way (SQLite and PostgreSQL disagree otherwise)
    first = F(column).desc(nulls_last=True) if desc else F(column).asc(nulls_last=True)
    return qs.order_by(first, "-id" if desc else "id")


def jobs_listed(user, query: JobQuery) -> QuerySet[Job]:
    """The jobs `user` may see (jobs_visible_to) that match `query`, in its order, with owner and
    team joined and tags prefetched: what one page of the list shows."""
    qs = access_selectors.jobs_visible_to(user).select_related("team")
    for f in FILTERS:
        if f.name in query.filters:
            qs = f.apply(qs, query.filters[f.name])
    if query.q:
        qs = qs.filter(name__icontains=query.q)
    return order_by(qs, query.ordering).prefetch_related("tags")


def page_ids(qs: QuerySet) -> QuerySet:
    """The ids of `qs` in its order, to page over: SQLite (and PostgreSQL without a matching index)
    sorts every matching row to find a page, and a row with its spec is ~2 KB, so the sort of the
    last page of 10,000 jobs by start time moved ~20 MB; ids and the sort key alone are a few
    hundred KB (bench/joblist.py: 142 -> 25 ms for that query). The page's rows are then fetched
    by id (`page_rows`)."""
    return qs.values_list("pk", flat=True)


def page_rows(qs: QuerySet, ids) -> list[Job]:
    """The rows of one page (`ids`, from `page_ids`) with everything `qs` joins, prefetches and
    annotates, in `qs`'s order."""
    return list(qs.filter(pk__in=list(ids)))
