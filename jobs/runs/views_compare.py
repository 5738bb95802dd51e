"""/compare/?jobs=3,7,9 (issue 25, section 2): any reported metric of the jobs overlaid against step or
time (static/js/compare.js reads the bucketed series API, jobs/telemetry/api_series.py) and the diff
of their specs by dotted path (trainyard/specdiff.py), rendered here.

Login required; only jobs the user may see: other ids are left out and named in a message (an id of
no job and one of another team's job read the same); none visible is a 404, a malformed list a 400.
"""
from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.shortcuts import render

from trainyard.specdiff import show, spec_diff
from jobs.access import selectors as access_selectors
from jobs.core.errors import InvalidInput
from jobs.telemetry.api_series import parse_job_ids
from jobs.telemetry.series import MAX_POINTS

# Curves a chart stays readable with, and what one series request carries (api_series caps at 50).
MAX_COMPARE_JOBS = 20


def compare_rows(jobs) -> tuple[list[dict], list[dict]]:
    """(the fields that differ, the identical ones), each {path, values: [text per job]}."""
    rows = spec_diff([j.spec for j in jobs])
    out = ([], [])
    for r in rows:
        out[0 if r.differs else 1].append({"path": r.path, "values": [show(v) for v in r.values]})
    return out


@login_required
def compare(request):
    raw = request.GET.get("jobs", "")
    try:
        ids = parse_job_ids(raw, cap=MAX_COMPARE_JOBS)
    except InvalidInput as exc:
        return render(request, "jobs/compare.html", {"error": exc.message, "jobs": []}, status=400)
    found = {j.pk: j for j in access_selectors.jobs_visible_to(request.user).filter(pk__in=ids)}
    jobs = [found[pk] for pk in ids if pk in found]
    missing = [pk for pk in ids if pk not in found]
    if not jobs:
        return render(request, "jobs/compare.html", {
            "error": f"No job {', '.join(map(str, missing))} visible to you.", "jobs": []}, status=404)
    differ, same = compare_rows(jobs)
    config = {"jobs": [{"id": j.pk, "name": j.name, "status": j.status, "owner": j.owner.username} for j in jobs],
              "max_points": MAX_POINTS}
    return render(request, "jobs/compare.html", {
        "jobs": jobs, "missing": missing, "differ": differ, "same": same, "config": config})
