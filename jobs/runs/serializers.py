"""DRF serializers of jobs, their attempts and checkpoints (the API's JSON).
"""
from __future__ import annotations
from django.conf import settings
from django.utils import timezone
from rest_framework import serializers
from jobs.attempts import selectors as attempts_selectors
from jobs.scheduling import selectors as scheduling_selectors
from jobs.telemetry import selectors as telemetry_selectors
from jobs.attempts.rows import checkpoint_row
from jobs.models import Attempt, Checkpoint, Job, Trial
from jobs.attempts.policy import diagnosis


class AttemptSerializer(serializers.ModelSerializer):
    """One attempt of a job, with its ranks (node, pid, place in the parallel plan)."""

    ranks = serializers.SerializerMethodField()
    slurm = serializers.SerializerMethodField()

    class Meta:
        model = Attempt
        fields = ["id", "number", "status", "outcome", "resumed_from", "resumed_from_step", "stop_reason", "failure",
                  "last_step", "last_progress_at", "stragglers", "profile", "created_at", "started_at", "ended_at",
                  "ranks", "slurm"]

    def get_ranks(self, obj) -> list[dict]:
        return attempts_selectors.attempt_rank_rows(obj)

    def get_slurm(self, obj) -> dict | None:
        """An attempt on a Slurm pool (issue 27): its Slurm job, what Slurm last said (state; while
        pending, the reason, its category and squeue --start's estimate) and its nodes; else null."""
        return attempts_selectors.attempt_slurm_row(obj)


class JobSerializer(serializers.ModelSerializer):
    """A job as the API, the job socket and the job page show it: its attempts, queue position,
    predicted start, stragglers and what the hang detector sees."""

    owner = serializers.CharField(source="owner.username", read_only=True)
    total_steps = serializers.IntegerField(read_only=True)
    queue_position = serializers.SerializerMethodField()
    predicted_start_at = serializers.SerializerMethodField()
    attempts = AttemptSerializer(many=True, read_only=True)
    stragglers = serializers.SerializerMethodField()
    health = serializers.SerializerMethodField()
    has_telemetry = serializers.SerializerMethodField()
    profile = serializers.SerializerMethodField()
    experiment = serializers.SerializerMethodField()
    team = serializers.CharField(source="team.name", read_only=True, allow_null=True, default=None)
    tags = serializers.SerializerMethodField()

    class Meta:
        model = Job
        fields = ["id", "name", "status", "status_reason", "owner", "team", "tags", "note", "spec", "plan", "step", "total_steps",
                  "priority", "restarts", "created_at", "started_at", "finished_at", "queue_position",
                  "predicted_start_at", "predicted_s", "borrowing", "avoid_nodes", "node_history", "adaptations", "stragglers",
                  "health",
                  "has_telemetry", "profile", "experiment", "attempts"]

    def get_experiment(self, obj) -> int | None:
        """The experiment this job is a trial of (issue 25), or null."""
        try:
            trial = obj.trial  # select_related by the API's queryset
        except Trial.DoesNotExist:
            return None
        return trial.experiment_id

    def get_tags(self, obj) -> list[str]:
        """The job's tags now (editable after submit: PATCH; the spec keeps those it was submitted with)."""
        return [t.name for t in obj.tags.all()]  # prefetched by the API's queryset

    def get_has_telemetry(self, obj) -> bool:
        """Whether any attempt of the job ever sent a metric sample (a script that does not use the
        Trainyard SDK sends none): the job page shows charts, or says telemetry is unavailable."""
        known = getattr(obj, "has_telemetry", None)  # annotated by the API's queryset
        return bool(known) if known is not None else telemetry_selectors.job_has_telemetry(obj.pk)

    def _current(self, obj) -> Attempt | None:
        attempts = sorted(obj.attempts.all(), key=lambda a: a.number)  # prefetched: no query
        return attempts[-1] if attempts else None

    def get_stragglers(self, obj) -> list[dict]:
        a = self._current(obj)
        return list(a.stragglers) if a is not None and a.status != Attempt.Status.ENDED else []

    def get_profile(self, obj) -> dict | None:
        """The running attempt's profile (jobs/attempts/policy/profiling.py: class, shares, window,
        recommendation with its change and predicted gain), with "attempt" (its id); null when
        no attempt runs or none was profiled yet."""
        a = self._current(obj)
        if a is None or a.status != Attempt.Status.RUNNING or not a.profile:
            return None
        return {**a.profile, "attempt": a.pk}

    def get_health(self, obj) -> dict:
        """What the hang detector sees for the running attempt."""
        a = self._current(obj)
        if a is None or a.status != Attempt.Status.RUNNING:
            return {"last_progress_at": None, "hang_timeout_s": None, "hang_timeout_source": None}
        if not diagnosis.hang_armed(obj.spec.get("hang_timeout_s", "auto"), user_code=bool(obj.spec.get("entrypoint")),
                                    last_progress=a.last_progress_at and a.last_progress_at.timestamp()):
            return {"last_progress_at": None, "hang_timeout_s": None, "hang_timeout_source": "auto: from the first step"}
        timeout, source = diagnosis.hang_timeout(obj.spec.get("hang_timeout_s", "auto"),
                                                 attempts_selectors.attempt_recent_step_s(a.pk, a.last_step),
                                                 settings.TRAINYARD_HANG_FLOOR_S)
        return {"last_progress_at": a.last_progress_at and timezone.localtime(a.last_progress_at).isoformat(),
                "hang_timeout_s": round(timeout, 1), "hang_timeout_source": source}

    def get_queue_position(self, obj) -> int | None:
        if obj.status != Job.Status.QUEUED:  # only queued jobs have one: no cluster view for a page without them
            return None
        positions = self.context.get("queue_positions")
        if positions is None:
            positions = self.context["queue_positions"] = scheduling_selectors.queue_positions()
        return positions.get(obj.pk)

    def get_predicted_start_at(self, obj) -> str | None:
        if obj.status != Job.Status.QUEUED or obj.predicted_start_at is None:
            return None
        return timezone.localtime(obj.predicted_start_at).isoformat()


class JobSubmittedSerializer(JobSerializer):
    """The submit's answer: the job, and `warnings` (why no registered node can run it yet: its
    device, GPU memory or labels; it is queued anyway and waits for such a node)."""

    warnings = serializers.SerializerMethodField()

    class Meta(JobSerializer.Meta):
        fields = [*JobSerializer.Meta.fields, "warnings"]

    def get_warnings(self, obj) -> list[str]:
        return list(getattr(obj, "warnings", None) or [])


class CheckpointSerializer(serializers.ModelSerializer):
    """A registered checkpoint: where, how big, how long it took, and its retention state."""

    attempt = serializers.IntegerField(source="attempt_id", allow_null=True)
    deleted = serializers.SerializerMethodField()

    class Meta:
        model = Checkpoint
        fields = ["id", "step", "attempt", "created_at", "size_bytes", "blocking_s", "save_s", "superseded",
                  "pinned", "deleted", "deleted_at", "path"]

    def get_deleted(self, obj) -> bool:
        return obj.deleted_at is not None

    def to_representation(self, instance: Checkpoint) -> dict:
        return checkpoint_row(instance)  # the fields above are the schema; the row is built once (jobs/attempts/rows.py)
