"""What a node's heartbeat says it has (pure): the summary the fleet keeps on the Node row."""
from __future__ import annotations

from typing import Iterable, Mapping


def summarize_devices(devices: Iterable[Mapping]) -> tuple[str, int, int]:
    """(kind, GPUs, smallest GPU's total memory in bytes) of a heartbeat's `devices`: kind "cuda"
    when it lists any CUDA device, "cpu" when it lists only CPU slots, "" when it lists nothing
    (a cuda agent whose NVML failed this heartbeat, or no heartbeat yet)."""
    gpus = [d for d in devices if isinstance(d, Mapping) and d.get("kind") == "cuda"]
    if gpus:
        mems = [d.get("memory_bytes") for d in gpus]
        smallest = min((int(m) for m in mems if isinstance(m, (int, float)) and not isinstance(m, bool)), default=0)
        return "cuda", len(gpus), max(0, smallest)
    return ("cpu" if any(isinstance(d, Mapping) for d in devices) else ""), 0, 0
