"""Who sees which jobs: their own, their teams', and staff all.
"""
from __future__ import annotations
from django.db.models import Q, QuerySet
from jobs.models import Job


def jobs_visible_to(user) -> QuerySet[Job]:
    qs = Job.objects.select_related("owner")
    if user.is_staff:
        return qs
    # Users see their own jobs and their teams' jobs.
    return qs.filter(Q(owner=user) | Q(team__in=user.groups.all())).distinct()
