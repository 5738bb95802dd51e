"""A cpu rank's device memory, enforced (TRAINYARD_CPU_DEVICE_MEMORY_ENFORCE on the control plane):
RLIMIT_DATA set to what the rank's data segment holds once started (the interpreter, torch, the
process group: VmData in /proc/self/status) plus the device's memory, so the model, its optimizer
state and the activations get exactly that much. RLIMIT_DATA counts private writable memory (the
heap and anonymous mappings, where torch's CPU allocator puts every tensor), not the libraries'
code or reserved address space as RLIMIT_AS would, so the margin is the tensors' and not torch's
own. An allocation past it fails the way a GPU's does: torch raises "DefaultCPUAllocator: can't
allocate memory: you tried to allocate N bytes", which the control plane's diagnosis reads as an OOM.
Linux only (the limit is a no-op where /proc is missing).
"""
from __future__ import annotations

import re
import resource
from pathlib import Path

GIB = 1 << 30


def data_bytes() -> int | None:
    """This process's data segment (VmData), or None where /proc does not say."""
    try:
        found = re.search(r"^VmData:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    except OSError:
        return None
    return int(found.group(1)) * 1024 if found else None


def cap_memory(limit_gb: float) -> int | None:
    """Allow this process `limit_gb` more private writable memory than it holds now; the limit
    set (bytes), or None when the size is unknown."""
    now = data_bytes()
    if now is None:
        return None
    limit = now + int(limit_gb * GIB)
    _soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    return limit
