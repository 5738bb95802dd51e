"""GPU faults a node agent reported through NVML, as evidence against the node (pure).

The agent's heartbeat carries, per GPU, its critical Xid events (each with the agent's Unix time)
and the volatile uncorrected ECC error count (since the driver loaded; it stays until the GPU is
reset). Both count toward the node's quarantine together with the attempt failures it was
implicated in (jobs/attempts/services/attempts.py). Xids that user code or a killed process cause are
shown on the node card but are not the node's fault.
"""
from __future__ import annotations

from dataclasses import dataclass

# NVIDIA's Xid catalogue: 13 graphics engine exception, 31 GPU memory page fault (an illegal address
# in a kernel), 43 GPU stopped processing (the app's fault), 45 preemptive cleanup (a CUDA process
# was killed -- every stopped rank makes one). The rest (48 DBE ECC, 63/64 page retirement, 74
# NVLink, 79 fallen off the bus, 92/94/95 ECC, 119/120 GSP, ...) are the hardware's or the driver's.
USER_XIDS = frozenset({13, 31, 43, 45})


@dataclass(frozen=True)
class GpuFault:
    gpu: str  # "GPU <nvml index> (<uuid>)"
    what: str  # "Xid 79", "3 uncorrected ECC errors"
    at: float | None  # Unix time of an Xid; None for a standing ECC count

    def text(self) -> str:
        return f"{self.gpu}: {self.what}"


def _label(d: dict) -> str:
    index = d.get("nvml_index", d.get("index"))
    return f"GPU {index}" + (f" ({d['uuid']})" if d.get("uuid") else "")


def gpu_faults(devices: list, *, since: float) -> list[GpuFault]:
    """The node's GPU faults that count against it: critical Xid events at or after `since` (Unix
    time) other than USER_XIDS, and one per GPU whose uncorrected ECC count is above zero."""
    out: list[GpuFault] = []
    for d in devices or []:
        if not isinstance(d, dict) or d.get("kind") != "cuda":
            continue
        for e in d.get("xid_events") or []:
            try:
                xid, at = int(e["xid"]), float(e["at"])
            except (KeyError, TypeError, ValueError):
                continue
            if at >= since and xid not in USER_XIDS:
                out.append(GpuFault(_label(d), f"Xid {xid}", at))
        ecc = d.get("ecc_uncorrected")
        if isinstance(ecc, int) and ecc > 0:
            out.append(GpuFault(_label(d), f"{ecc} uncorrected ECC error{'s' if ecc != 1 else ''}", None))
    return out


def quarantine_due(failures: int, faults: list[GpuFault], threshold: int) -> bool:
    """Attempt failures blamed on the node plus its GPU faults reach the quarantine threshold."""
    return failures + len(faults) >= threshold
