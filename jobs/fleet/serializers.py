"""A node as the API returns it.
"""
from __future__ import annotations
from rest_framework import serializers
from jobs.fleet import selectors
from jobs.models import Node


class NodeSerializer(serializers.ModelSerializer):
    """A node with its slots in use, devices, load and drain/quarantine state."""

    slots_used = serializers.SerializerMethodField()

    class Meta:
        model = Node
        fields = ["name", "status", "slots", "slots_used", "address", "labels", "devices", "device_kind",
                  "gpu_count", "gpu_memory_bytes", "cpu_percent",
                  "mem_percent", "last_heartbeat", "quarantined_at", "quarantine_reason", "drain_mode"]

    def get_slots_used(self, obj) -> int:
        used = self.context.get("slots_used")
        if used is None:
            used = self.context["slots_used"] = selectors.slots_used_by_node()
        return used.get(obj.pk, 0)
