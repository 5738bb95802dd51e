"""An experiment as the API and its pages show it (issue 25's pinned JSON)."""
from __future__ import annotations

from rest_framework import serializers

from jobs.experiments import selectors
from jobs.models import Experiment, Trial


def trial_row(t: Trial) -> dict:
    """One trial: its job, values, status, best metric, the highest ASHA rung reached, steps read."""
    reached = [int(k) for k in (t.rung_values or {})]
    return {"number": t.number, "job": t.job_id, "values": t.values, "status": t.status,
            "status_reason": t.status_reason, "metric": t.metric, "rung": max(reached) if reached else None,
            "rung_values": t.rung_values or {}, "steps": t.steps,
            "job_status": t.job.status if t.job is not None else None,
            "created_at": t.created_at.isoformat(), "ended_at": t.ended_at.isoformat() if t.ended_at else None}


def best_row(experiment: Experiment, trials: list[Trial]) -> dict | None:
    t = selectors.best_trial(experiment, trials)
    if t is None:
        return None
    return {"job": t.job_id, "number": t.number, "values": t.values, "metric": t.metric, "status": t.status}


class ExperimentListSerializer(serializers.ModelSerializer):
    status = serializers.CharField(read_only=True, help_text="running | succeeded | failed | stopped")
    owner = serializers.CharField(source="owner.username", read_only=True)
    trials = serializers.SerializerMethodField()

    class Meta:
        model = Experiment
        fields = ["id", "name", "status", "status_reason", "owner", "search", "created_at", "finished_at", "trials"]

    def get_trials(self, obj) -> dict:
        """How many trials there are in each status."""
        counts: dict[str, int] = {}
        for t in obj.trials.all():
            counts[t.status] = counts.get(t.status, 0) + 1
        return counts


class ExperimentSerializer(serializers.ModelSerializer):
    """`best`: the trial with the best metric so far ({job, number, values, metric, status}) or
    null; `trials`: every trial, oldest first; `best_spec`: the best trial's JobSpec, ready to
    submit as a plain job."""

    status = serializers.CharField(read_only=True, help_text="running | succeeded | failed | stopped")
    owner = serializers.CharField(source="owner.username", read_only=True)
    team = serializers.CharField(source="team.name", read_only=True, default=None)
    best = serializers.SerializerMethodField()
    best_spec = serializers.SerializerMethodField()
    trials = serializers.SerializerMethodField()
    events = serializers.SerializerMethodField()

    class Meta:
        model = Experiment
        fields = ["id", "name", "status", "status_reason", "owner", "team", "spec", "search", "best", "best_spec",
                  "trials", "events", "created_at", "finished_at"]

    def _trials(self, obj) -> list[Trial]:
        if not hasattr(obj, "_trial_rows"):
            obj._trial_rows = list(obj.trials.select_related("job").order_by("number"))
        return obj._trial_rows

    def get_best(self, obj) -> dict | None:
        return best_row(obj, self._trials(obj))

    def get_best_spec(self, obj) -> dict | None:
        t = selectors.best_trial(obj, self._trials(obj))
        if t is None or t.job is None:
            return None
        spec = dict(t.job.spec)
        spec["name"] = f"{obj.name}-best"[:200]
        return spec

    def get_trials(self, obj) -> list[dict]:
        return [trial_row(t) for t in self._trials(obj)]

    def get_events(self, obj) -> list[dict]:
        """The newest 50 of the experiment's timeline, oldest first."""
        rows = list(obj.events.order_by("-id")[:50])
        return [{"kind": e.kind, "message": e.message, "data": e.data, "at": e.created_at.isoformat()}
                for e in reversed(rows)]


class ExperimentSubmittedSerializer(serializers.ModelSerializer):
    status = serializers.CharField(read_only=True, help_text="running")
    trials = serializers.SerializerMethodField()

    class Meta:
        model = Experiment
        fields = ["id", "name", "status", "search", "created_at", "trials"]

    def get_trials(self, obj) -> list[dict]:
        return [trial_row(t) for t in obj.trials.select_related("job").order_by("number")]
