"""Telemetry retention's settings (issue 26): the RetentionPolicy rows as the purge (jobs/telemetry/retention.py)
applies them and as the API (jobs/telemetry/api_retention.py) and the Django admin show and change them. The
site's row (team empty) is created with DEFAULTS the first time anything reads it; a team's row overrides the
site's field by field (its empty fields follow the site's; an empty site field uses DEFAULTS)."""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from django.db import transaction

from jobs.core.errors import InvalidInput
from jobs.models import Job, RetentionPolicy

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractUser

log = logging.getLogger(__name__)

DEFAULTS = {"rank_window_steps": 2000, "rank_sampled_per_rank": 1000, "rank_days": None, "reduced_days": None,
            "logs_days": None, "finished_jobs_days": None}
"""The site's settings when its row (or a field of it) is empty; None: forever."""
POLICY_FIELDS = tuple(DEFAULTS)
DAY_FIELDS = ("rank_days", "reduced_days", "logs_days", "finished_jobs_days")

@dataclass(frozen=True)
class Policy:
    rank_window_steps: int
    rank_sampled_per_rank: int
    rank_days: float | None
    reduced_days: float | None
    logs_days: float | None
    finished_jobs_days: float | None


# --- the rows ---------------------------------------------------------------------------------

def site_row() -> RetentionPolicy:
    """The site's row, created with DEFAULTS the first time anything reads it."""
    row = RetentionPolicy.objects.filter(team__isnull=True).first()
    if row is None:
        with transaction.atomic():
            row = RetentionPolicy.objects.select_for_update().filter(team__isnull=True).first()
            if row is None:
                row = RetentionPolicy.objects.create(team=None, **DEFAULTS)
    return row


def effective(site: RetentionPolicy | None, team: RetentionPolicy | None = None) -> Policy:
    """The settings that apply: the team's set fields, else the site's, else DEFAULTS."""
    values = {}
    for f in POLICY_FIELDS:
        v = getattr(team, f) if team is not None else None
        if v is None and site is not None:
            v = getattr(site, f)
        values[f] = DEFAULTS[f] if v is None else v
    return Policy(**values)


def policies() -> tuple[Policy, dict[int, Policy]]:
    """(the site's settings, team id -> that team's effective settings for teams with a row)."""
    site = site_row()
    teams = {r.team_id: effective(site, r) for r in RetentionPolicy.objects.filter(team__isnull=False)}
    return effective(site), teams


def policy_for(job: Job) -> Policy:
    site = site_row()
    team = RetentionPolicy.objects.filter(team_id=job.team_id).first() if job.team_id else None
    return effective(site, team)


# --- the API's view and change ----------------------------------------------------------------------------

_LIMITS = {"rank_window_steps": (1, 10**9), "rank_sampled_per_rank": (0, 10**9)}
MAX_DAYS = 100_000.0


def policy_row(row: RetentionPolicy | None) -> dict:
    return {f: (getattr(row, f) if row is not None else None) for f in POLICY_FIELDS}


def retention_table(*, teams: list[int] | None = None) -> dict:
    """What the API shows: the site's row (as stored; empty fields use DEFAULTS), its effective
    settings, and each team's row with its own fields and its effective settings. `teams`: only
    these teams' rows (None: all)."""
    site = site_row()
    rows = RetentionPolicy.objects.filter(team__isnull=False).select_related("team").order_by("team__name")
    if teams is not None:
        rows = rows.filter(team_id__in=teams)
    return {
        "defaults": dict(DEFAULTS),
        "site": {**policy_row(site), "effective": asdict(effective(site)), "updated_at": site.updated_at},
        "teams": [{"team": r.team.name, **policy_row(r), "effective": asdict(effective(site, r)),
                   "updated_at": r.updated_at} for r in rows],
    }


def _check_fields(values, where: str, errors: dict[str, list[str]]) -> dict:
    if not isinstance(values, dict):
        errors[where.rstrip(".") or "detail"] = ["must be an object"]
        return {}
    out = {}
    for k, v in values.items():
        if k == "team":
            continue
        if k not in POLICY_FIELDS:
            errors[f"{where}{k}"] = ["unknown field"]
        elif v is None:
            out[k] = None
        elif k in _LIMITS:
            lo, hi = _LIMITS[k]
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                errors[f"{where}{k}"] = [f"must be a whole number from {lo} to {hi} or null, got {v!r}"]
            else:
                out[k] = v
        elif isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= MAX_DAYS:
            errors[f"{where}{k}"] = [f"must be a number of days from 0 to {MAX_DAYS:.0f} or null (forever), got {v!r}"]
        else:
            out[k] = float(v)
    return out


def retention_update(*, actor: AbstractUser, data) -> None:
    """Change the settings, all or nothing. data: {"site": {field: value|null, ...},
    "teams": [{"team": name, field: value|null, ...}, ...]}; a field left out keeps its value, null
    clears it (the site's: DEFAULTS; a team's: the site's); a team whose fields all end up empty loses
    its row. Raises InvalidInput with field paths ("teams.0.rank_days")."""
    from django.contrib.auth.models import Group

    errors: dict[str, list[str]] = {}
    if not isinstance(data, dict) or not data:
        raise InvalidInput({"detail": ['send {"site": {...}, "teams": [{"team": name, ...}]}']})
    for k in sorted(set(data) - {"site", "teams"}):
        errors[k] = ["unknown field (site or teams)"]
    site = _check_fields(data["site"], "site.", errors) if "site" in data else None
    team_entries = data.get("teams", [])
    parsed = []
    if not isinstance(team_entries, list):
        errors["teams"] = ["must be a list of {team: name, ...}"]
        team_entries = []
    for i, e in enumerate(team_entries):
        where = f"teams.{i}."
        values = _check_fields(e, where, errors)
        name = e.get("team") if isinstance(e, dict) else None
        group = Group.objects.filter(name=name).first() if isinstance(name, str) else None
        if isinstance(e, dict) and group is None:
            errors[f"{where}team"] = [f"no team named {name!r}" if name is not None else "required"]
        parsed.append((group, values))
    if errors:
        raise InvalidInput(errors)
    with transaction.atomic():
        if site is not None:
            row = site_row()
            for k, v in site.items():
                setattr(row, k, v)
            row.save()
        for group, values in parsed:
            row = RetentionPolicy.objects.select_for_update().filter(team=group).first() or RetentionPolicy(team=group)
            for k, v in values.items():
                setattr(row, k, v)
            if all(getattr(row, f) is None for f in POLICY_FIELDS):
                if row.pk:
                    row.delete()
            else:
                row.save()
    log.info("retention settings changed by %s: %s", actor, data)
