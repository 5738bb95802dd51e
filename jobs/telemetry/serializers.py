"""A metric sample as the API returns it.
"""
from __future__ import annotations
from rest_framework import serializers
from jobs.models import MetricSample


class MetricSerializer(serializers.ModelSerializer):
    """One metric sample (one rank, one step); `metrics` holds the user's own metrics ({name: float},
    null when the sample has none)."""

    attempt = serializers.IntegerField(source="attempt_id")
    metrics = serializers.JSONField(source="extra", read_only=True)

    class Meta:
        model = MetricSample
        fields = list(MetricSample.FIELDS) + ["attempt", "metrics"]
