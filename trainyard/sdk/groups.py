"""The run's process groups and their collective timeout (the launch config's
`collective_timeout_s`, which the control plane keeps under its hang detector's).

From the first step on (`Run.log` calls `apply_collective_timeout`), every group made through
this module times a collective out after that many seconds, so a collective stuck on a dead or
missing peer fails its rank with torch's timeout error (and, on NCCL, a flight-recorder dump)
before the attempt is stopped as hung. Until then the groups keep torch's defaults (10 minutes
NCCL, 30 gloo): the hang detector gives a start-up (imports, data, a barrier while rank 0
prepares something) longer too. `dist.new_group` alone would never get it: torch gives a new
group its own default, not the default group's. The checkpoint group keeps torch's default on
purpose: an async save runs on while steps progress. torch is imported when a function runs
(the module imports without it, as the SDK's torch-free modules do).
"""
from __future__ import annotations

from datetime import timedelta

_COLLECTIVE_TIMEOUT: timedelta | None = None
_GROUPS: list = []  # every process group of this run, to tighten at the first step
_APPLIED = False


def configure(timeout_s: float | None) -> None:
    """A new run (init_process_group): its collective timeout, no groups tracked yet."""
    global _COLLECTIVE_TIMEOUT, _APPLIED
    _COLLECTIVE_TIMEOUT = timedelta(seconds=timeout_s) if timeout_s else None
    _GROUPS.clear()
    _APPLIED = False


def track_group(group) -> None:
    """Give `group` the collective timeout from the first step on (now, if that has passed).
    For groups made elsewhere (the default group, a device mesh's); a rank outside: nothing."""
    import torch.distributed as dist

    if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
        return
    _GROUPS.append(group)
    if _APPLIED and _COLLECTIVE_TIMEOUT is not None:
        dist.distributed_c10d._set_pg_timeout(_COLLECTIVE_TIMEOUT, group)


def new_group(*args, **kwargs):
    """`dist.new_group`, tracked for the collective timeout."""
    import torch.distributed as dist

    group = dist.new_group(*args, **kwargs)
    track_group(group)
    return group


def apply_collective_timeout() -> bool:
    """Start-up is over: every tracked group (and any made later) gets the collective timeout.
    Idempotent; True when it changed something."""
    global _APPLIED
    import torch.distributed as dist

    if _APPLIED or _COLLECTIVE_TIMEOUT is None or not dist.is_initialized():
        return False
    _APPLIED = True
    for group in _GROUPS:
        dist.distributed_c10d._set_pg_timeout(_COLLECTIVE_TIMEOUT, group)
    return True
