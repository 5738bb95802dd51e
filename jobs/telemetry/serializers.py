"""A job's metric rows as the API returns them: a per-step row (every rank reduced: the default) or
one rank's sample (the drill-down).
"""
from __future__ import annotations
from rest_framework import serializers
from jobs.models import MetricSample, MetricStep
from jobs.models.telemetry import RANKED_FIELDS, REDUCED_FIELDS


class MetricSerializer(serializers.ModelSerializer):
    """One metric sample (one rank, one step); `metrics` holds the user's own metrics ({name: float},
    null when the sample has none)."""

    attempt = serializers.IntegerField(source="attempt_id")
    metrics = serializers.JSONField(source="extra", read_only=True)

    class Meta:
        model = MetricSample
        fields = list(MetricSample.FIELDS) + ["attempt", "metrics"]


def _reduced_fields() -> dict:
    out: dict = {}
    for f in REDUCED_FIELDS:
        out[f] = serializers.FloatField(source=f"{f}_mean", allow_null=True, read_only=True,
                                        help_text=f"the mean of {f} over the ranks that reported it")
        out[f"{f}_min"] = serializers.FloatField(allow_null=True, read_only=True)
        out[f"{f}_max"] = serializers.FloatField(allow_null=True, read_only=True)
        out[f"{f}_n"] = serializers.IntegerField(read_only=True, help_text=f"ranks that reported {f}")
    for f in RANKED_FIELDS:
        out[f"{f}_min_rank"] = serializers.IntegerField(allow_null=True, read_only=True,
                                                        help_text=f"the rank with the lowest {f}")
        out[f"{f}_max_rank"] = serializers.IntegerField(allow_null=True, read_only=True,
                                                        help_text=f"the rank with the highest {f}")
    return out


class _StepBase(serializers.ModelSerializer):
    attempt = serializers.IntegerField(source="attempt_id", read_only=True)
    rank = serializers.SerializerMethodField(help_text="always null: a per-step row is every rank's")
    metrics = serializers.JSONField(source="extra", read_only=True,
                                    help_text="the user's own metrics of the lowest rank that logged any this step")
    metrics_rank = serializers.IntegerField(source="extra_rank", allow_null=True, read_only=True)

    def get_rank(self, obj) -> int | None:
        return None


# The standard fields under the names a sample has (loss = loss_mean, ...) plus each one's _min, _max
# and _n, and the ranks of the extremes of RANKED_FIELDS: built in a loop like the model's columns.
MetricStepSerializer = type("MetricStepSerializer", (_StepBase,), {
    "__doc__": """One step of a job, every rank reduced (MetricStep): `ranks` reported it, `ts` is the
    latest rank's; each standard field under its sample name is the mean over the ranks that reported
    it (so a client of per-rank rows reads a sensible value), with `<field>_min`, `<field>_max` and
    `<field>_n`; for step_s, loss and compute_s also `<field>_min_rank` / `<field>_max_rank`. `rank`
    is null; `metrics` are the user metrics of rank `metrics_rank` (the lowest that logged any).""",
    **_reduced_fields(),
    "Meta": type("Meta", (), {"model": MetricStep,
                              "fields": ["attempt", "step", "ts", "ranks", "rank",
                                         *[k for k in _reduced_fields()], "metrics", "metrics_rank"]}),
    "__module__": __name__,
})
