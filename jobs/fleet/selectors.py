"""Reads about the fleet's nodes.
"""
from __future__ import annotations
from jobs.models import Allocation


def slots_used_by_node() -> dict[int, int]:
    used: dict[int, int] = {}
    for node_id, slot_ids in Allocation.objects.filter(active=True).values_list("node_id", "slot_ids"):
        used[node_id] = used.get(node_id, 0) + len(slot_ids)
    return used
