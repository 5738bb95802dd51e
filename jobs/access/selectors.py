"""Who sees which jobs: their own, their teams', and staff all.
"""
from __future__ import annotations
from django.db.models import Q, QuerySet
from jobs.models import Job


def jobs_visible_to(user) -> QuerySet[Job]:
    qs = Job.objects.select_related("owner")
    if user.is_staff:
        return qs
    # Users see their own jobs and their teams' jobs. A job has one team, and the user's teams are a
    # subquery (team_id IN (SELECT ...)), not a join: no row can repeat, so no DISTINCT, which made
    # the database compare whole rows, spec JSON included (bench/joblist.py: the 10,000-job list).
    return qs.filter(Q(owner=user) | Q(team__in=user.groups.all()))
