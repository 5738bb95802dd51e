"""The node agent's view of its GPUs, through NVML -- never through CUDA.

`torch.cuda` in the agent would create a CUDA context on every GPU it touches (hundreds of MB
each, kept for the agent's life): under exclusive-process compute mode the ranks could then not
start, and one sticky CUDA error would turn the node into a CPU node until the agent restarts.
NVML (the driver's management library, `pynvml` from the nvidia-ml-py package) reads the same
figures -- name, UUID, memory, utilization, temperature, ECC counters, Xid events -- without a
context.

Slots map through the agent's own CUDA_VISIBLE_DEVICES (Slurm and containers set it; indices in
PCI bus order, or GPU-/MIG- UUIDs): slot i is the i-th visible GPU. The ranks get
CUDA_DEVICE_ORDER=PCI_BUS_ID (workers/launch_spec.py) so CUDA's numbering is NVML's.
"""
from __future__ import annotations

import collections
import logging
import time
from typing import Any

log = logging.getLogger("trainyard.agent.gpus")
XID_KEEP = 20  # the last Xid events per GPU carried in every heartbeat (the control plane counts a window)


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used here: the package is missing, or the driver is absent or broken."""


def visible_entries(value: str | None) -> list[str] | None:
    """The agent's CUDA_VISIBLE_DEVICES as a list of entries; None when unset (every GPU visible).
    CUDA stops at the first invalid entry, and so does this."""
    if value is None:
        return None
    out: list[str] = []
    for part in (p.strip() for p in value.split(",")):
        if not part or not (part.isdigit() or part.startswith(("GPU-", "MIG-"))):
            break
        out.append(part)
    return out


def slot_devices(slots: tuple[int, ...] | list[int], agent_visible: str | None) -> list[str]:
    """The ranks' CUDA_VISIBLE_DEVICES entries for these slots: slot i is the agent's i-th visible GPU."""
    entries = visible_entries(agent_visible)
    if entries is None:
        return [str(s) for s in slots]
    bad = [s for s in slots if s >= len(entries)]
    if bad:
        raise ValueError(f"slots {bad} are beyond the {len(entries)} GPUs this agent sees "
                         f"(CUDA_VISIBLE_DEVICES={agent_visible!r})")
    return [entries[s] for s in slots]


def _nvml():
    try:
        import pynvml
    except ImportError as exc:
        raise NvmlUnavailable(f"pynvml is not installed ({exc}); requirement: nvidia-ml-py") from exc
    return pynvml


def _supported(pynvml, fn, *args) -> Any:
    """fn(*args), or None where this GPU or driver does not offer it."""
    try:
        return fn(*args)
    except pynvml.NVMLError as exc:
        if exc.value in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
            return None
        raise


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class GpuMonitor:
    """NVML handles for the GPUs this agent may use, Xid event listening, and one snapshot per
    heartbeat. `start()` raises NvmlUnavailable; after that, `devices()` never raises."""

    def __init__(self, agent_visible: str | None):
        self.agent_visible = agent_visible
        self.nvml = None
        self.handles: list[tuple[int, Any]] = []  # (nvml index, handle), in slot order
        self.event_set = None
        self.xid_supported: dict[int, bool] = {}
        self.xid_events: dict[int, collections.deque] = {}
        self.xid_counts: collections.Counter = collections.Counter()
        self.error = ""

    def start(self) -> GpuMonitor:
        pynvml = _nvml()
        try:
            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handles = self._visible_handles(pynvml)
        except pynvml.NVMLError as exc:
            raise NvmlUnavailable(f"NVML failed: {exc} (is the NVIDIA driver installed and loaded?)") from exc
        self._register_xid(pynvml)
        return self

    def _visible_handles(self, pynvml) -> list[tuple[int, Any]]:
        entries = visible_entries(self.agent_visible)
        if entries is None:
            entries = [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
        out = []
        for entry in entries:
            try:
                if entry.isdigit():
                    handle = pynvml.nvmlDeviceGetHandleByIndex(int(entry))
                else:
                    handle = pynvml.nvmlDeviceGetHandleByUUID(entry)
                index = int(pynvml.nvmlDeviceGetIndex(handle))
            except pynvml.NVMLError as exc:  # like CUDA: the GPUs before an unknown entry are visible
                log.error("CUDA_VISIBLE_DEVICES=%s: no GPU %r here (%s); using the %s before it",
                          self.agent_visible, entry, exc, len(out))
                break
            out.append((index, handle))
        return out

    def _register_xid(self, pynvml) -> None:
        """Listen for critical Xid errors on every visible GPU where NVML offers it."""
        try:
            self.event_set = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as exc:
            log.warning("NVML events unavailable (%s): Xid errors will not be reported", exc)
            self.event_set = None
        for index, handle in self.handles:
            self.xid_events[index] = collections.deque(maxlen=XID_KEEP)
            ok = False
            if self.event_set is not None:
                try:
                    types = _supported(pynvml, pynvml.nvmlDeviceGetSupportedEventTypes, handle) or 0
                    if types & pynvml.nvmlEventTypeXidCriticalError:
                        pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, self.event_set)
                        ok = True
                except pynvml.NVMLError as exc:
                    log.warning("GPU %s: cannot listen for Xid errors (%s)", index, exc)
            self.xid_supported[index] = ok
            if not ok:
                log.warning("GPU %s: NVML does not report Xid errors here; they will not count toward quarantine",
                            index)

    @property
    def count(self) -> int:
        return len(self.handles)

    def poll_xid(self) -> None:
        """Drain the Xid events NVML has queued, without waiting (timeout 0)."""
        pynvml = self.nvml
        if pynvml is None or self.event_set is None:
            return
        for _ in range(1000):  # a storm of events must not hold up the heartbeat
            try:
                data = pynvml.nvmlEventSetWait_v2(self.event_set, 0)
            except pynvml.NVMLError as exc:
                if exc.value != pynvml.NVML_ERROR_TIMEOUT:
                    log.warning("NVML event wait failed: %s", exc)
                return
            if data.eventType & pynvml.nvmlEventTypeXidCriticalError:
                try:
                    index = int(pynvml.nvmlDeviceGetIndex(data.device))
                except pynvml.NVMLError:
                    index = -1
                event = {"xid": int(data.eventData), "at": time.time()}
                log.error("GPU %s: Xid %s (critical)", index, event["xid"])
                self.xid_events.setdefault(index, collections.deque(maxlen=XID_KEEP)).append(event)
                self.xid_counts[index] += 1

    def slot_nodes(self, slots: tuple[int, ...] | list[int]) -> tuple[list[str], list[str]]:
        """(UUIDs, /dev/nvidia<minor> paths) of these slots' GPUs: what a sandbox binds and what its
        ranks name in CUDA_VISIBLE_DEVICES (only these GPUs' device nodes are in the sandbox, so CUDA
        numbers them from 0: UUIDs are the names that stay right). Raises NvmlUnavailable."""
        pynvml = self.nvml
        if pynvml is None:
            raise NvmlUnavailable("NVML is not started")
        uuids, nodes = [], []
        try:
            for slot in slots:
                _, handle = self.handles[slot]
                uuids.append(_text(pynvml.nvmlDeviceGetUUID(handle)))
                nodes.append(f"/dev/nvidia{int(pynvml.nvmlDeviceGetMinorNumber(handle))}")
        except (IndexError, pynvml.NVMLError) as exc:
            raise NvmlUnavailable(f"cannot name the GPUs of slots {list(slots)}: {exc}") from exc
        return uuids, nodes

    def devices(self) -> list[dict]:
        """One dict per visible GPU, in slot order (the heartbeat's `devices`); [] if NVML fails now."""
        if self.nvml is None:
            return []
        try:
            self.poll_xid()
            return [self._device(slot, index, handle) for slot, (index, handle) in enumerate(self.handles)]
        except self.nvml.NVMLError as exc:  # a GPU fell off the bus, the driver went away
            if str(exc) != self.error:
                log.error("NVML query failed: %s: reporting no GPUs this heartbeat", exc)
            self.error = str(exc)
            return []

    def _device(self, slot: int, index: int, handle: Any) -> dict:
        pynvml = self.nvml
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        util = _supported(pynvml, pynvml.nvmlDeviceGetUtilizationRates, handle)
        temp = _supported(pynvml, pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU)
        ecc = _supported(pynvml, pynvml.nvmlDeviceGetTotalEccErrors, handle,
                         pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
        events = list(self.xid_events.get(index, ()))
        return {
            # kind/index/name/memory_bytes/memory_used_bytes/utilization: as before NVML (index = slot)
            "kind": "cuda", "index": slot, "name": _text(pynvml.nvmlDeviceGetName(handle)),
            "memory_bytes": int(mem.total), "memory_used_bytes": int(mem.used),
            "utilization": None if util is None else int(util.gpu),
            "nvml_index": index, "uuid": _text(pynvml.nvmlDeviceGetUUID(handle)),
            "temperature_c": None if temp is None else int(temp),
            "ecc_uncorrected": None if ecc is None else int(ecc),
            "xid_supported": self.xid_supported.get(index, False),
            "xid_errors": self.xid_counts[index], "xid_events": events,
        }
