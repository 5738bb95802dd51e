"""Staging for async checkpoints: which of the state's entries this rank writes, and the host
copy of just those, kept between saves, page-locked up to a cap.

Which entries a rank writes. DCP's save plans every entry on every rank that holds it, then its
coordinator drops the duplicates (`dedup_save_plans`: each (fqn, chunk) stays on the holder with
the least planned bytes so far; under DDP every parameter and optimizer tensor is replicated, so
with two ranks each writes about half). The dedup happens inside dcp.save, after the copy, so a
stager that copies before it cannot know its share and copied everything: every rank held a full
copy of the model and optimizer state (pinned on CUDA) for the whole run. `plan_share` runs the
same dedup first, on the save thread: each rank's local plan (the DefaultSavePlanner's, items
only) is all-gathered on the checkpoint group, and every rank runs dedup_save_plans on the same
list, so all agree. `ShareSavePlanner` then keeps only this rank's items in the plan dcp.save
builds: the global dedup finds no duplicates left, the metadata still names every entry (the
union of the shares), and nothing outside the share is read, so it need not be copied. DTensor
shards (FSDP, TP) are distinct chunks and stay with their holder; replicated chunks are shared
out like plain tensors.

The host copy. `ShareStager` copies the share (a flat dict fqn -> value) with torch's
StateDictStager, which caches one host storage per source storage and refills it at the next
save. On CUDA, entries are pinned in order until `pin_limit_bytes` is reached; the rest go to
a pageable stager (a slower copy, but memory the OS can page). The split is fixed
for a given share, so the same tensors stay pinned from save to save; when the share changes
both caches are dropped. Copies run on the Checkpointer's save thread, which is bound to the
rank's device (`bind_device`), on a stream of that device.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan


def bind_device(device: torch.device) -> None:
    """The save thread's initializer: make the rank's device current before any CUDA call there
    (a new thread starts on device 0, and its first CUDA call would create a context on it)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def pin_limit_bytes(fraction: float, local_world_size: int) -> int:
    """This rank's cap on page-locked staging memory: `fraction` of the host's RAM, split evenly
    between the ranks on the node."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not a POSIX host
        return 0
    return int(total * fraction) // max(local_world_size, 1)


def plan_share(state: dict, group: Any, rank: int) -> tuple[dict, dict, set[MetadataIndex]]:
    """(flat state, its flatten mappings, the write items this rank writes): a collective on
    `group`, to be called by every rank in the same order as their saves."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=False)
    local = SavePlan(planner.create_local_plan().items)
    plans: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(plans, local, group=group)
    share = {item.index for item in dedup_save_plans(plans)[dist.get_group_rank(group, rank)].items}
    return planner.state_dict, planner.mappings, share


class ShareSavePlanner(DefaultSavePlanner):
    """DCP's default save planner restricted to this rank's share (`plan_share`)."""

    def __init__(self, share: set[MetadataIndex]):
        super().__init__()
        self.share = share

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        self.plan = dataclasses.replace(plan, items=[i for i in plan.items if i.index in self.share])
        return self.plan


def _storage_bytes(value: Any) -> int:
    local = value.to_local() if hasattr(value, "to_local") else value
    return local.untyped_storage().nbytes()


class ShareStager:
    """Copies a flat dict of tensors into host memory kept between saves; pinned up to
    `pin_limit_bytes` when `pin_memory`, pageable beyond it."""

    def __init__(self, *, pin_memory: bool, pin_limit_bytes: int):
        self.pin_memory, self.pin_limit_bytes = pin_memory, pin_limit_bytes
        self._keys: tuple | None = None  # the share the caches hold copies of
        self._pinned_keys: set[str] = set()
        self.pinned_bytes = 0  # page-locked for the share (storages of the pinned entries)
        self.staged_bytes = 0  # copied at the last stage(), pinned and pageable
        self._stream: Any = None
        self._pinned = self._pageable = None

    def _reset(self, flat: dict) -> None:
        """A new share: drop the old copies and split the new one, in order, at the cap."""
        self.close()
        self._pinned = StateDictStager(pin_memory=True) if self.pin_memory else None
        self._pageable = StateDictStager(pin_memory=False)
        self._keys, self._pinned_keys, self.pinned_bytes = tuple(flat), set(), 0
        for key, value in flat.items():
            size = _storage_bytes(value)
            if self._pinned is not None and self.pinned_bytes + size <= self.pin_limit_bytes:
                self._pinned_keys.add(key)
                self.pinned_bytes += size

    def stage(self, flat: dict) -> dict:
        """Host copies of `flat`'s tensors (same keys), complete when this returns."""
        if tuple(flat) != self._keys:
            self._reset(flat)
        pinned = {k: v for k, v in flat.items() if k in self._pinned_keys}
        pageable = {k: v for k, v in flat.items() if k not in self._pinned_keys}
        cuda = next((v.device for v in flat.values() if v.device.type == "cuda"), None)
        if cuda is None:
            out = dict(self._pageable.stage(pageable, non_blocking=False))
            out.update(self._pinned.stage(pinned, non_blocking=False) if pinned else {})
        else:  # on a stream of ours, so the copies do not queue behind the training's kernels
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=cuda)
            with torch.cuda.stream(self._stream):
                out = dict(self._pinned.stage(pinned, non_blocking=True)) if pinned else {}
                out.update(self._pageable.stage(pageable, non_blocking=False))
            self._stream.synchronize()
        self.staged_bytes = sum(_storage_bytes(v) for v in flat.values())
        return {k: out[k] for k in flat}

    def close(self) -> None:
        """Free the copies (pinned memory is unpinned as its storage is freed)."""
        for stager in (self._pinned, self._pageable):
            if stager is not None:
                stager.close()
        self._pinned = self._pageable = None
        self._keys, self.pinned_bytes = None, 0
