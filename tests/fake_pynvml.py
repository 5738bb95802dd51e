"""A fake `pynvml` (nvidia-ml-py) for the agent's GPU tests: installed at the library boundary
(sys.modules["pynvml"]), it models a node's GPUs, their counters and a queue of Xid events with
the binding's names, constants and error convention (NVMLError.value)."""
from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field

NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_DRIVER_NOT_LOADED = 9


class NVMLError(Exception):
    def __init__(self, value: int):
        super().__init__(f"NVML error {value}")
        self.value = value


@dataclass
class Gpu:
    uuid: str
    name: str = "NVIDIA H200"
    total: int = 141 * 2**30
    used: int = 2**30
    util: int | None = 37
    temp: int | None = 41
    ecc: int | None = 0
    xid: bool = True  # offers nvmlEventTypeXidCriticalError


@dataclass
class FakeNvml:
    gpus: list[Gpu]
    init_error: int | None = None
    pending: list[tuple[int, int]] = field(default_factory=list)  # (nvml index, xid)
    registered: set = field(default_factory=set)
    calls: list[str] = field(default_factory=list)

    def module(self) -> types.ModuleType:
        m = types.ModuleType("pynvml")
        m.NVMLError = NVMLError
        m.NVML_ERROR_NOT_SUPPORTED = NVML_ERROR_NOT_SUPPORTED
        m.NVML_ERROR_TIMEOUT = NVML_ERROR_TIMEOUT
        m.NVML_ERROR_FUNCTION_NOT_FOUND = NVML_ERROR_FUNCTION_NOT_FOUND
        m.NVML_TEMPERATURE_GPU = 0
        m.NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
        m.NVML_VOLATILE_ECC = 0
        m.nvmlEventTypeXidCriticalError = 0x8
        for name in dir(self):
            if name.startswith("nvml"):
                setattr(m, name, getattr(self, name))
        return m

    def install(self, monkeypatch) -> FakeNvml:
        monkeypatch.setitem(sys.modules, "pynvml", self.module())
        return self

    def _gpu(self, handle: int) -> Gpu:
        return self.gpus[handle]

    @staticmethod
    def _need(value):
        if value is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return value

    def nvmlInit(self):
        self.calls.append("init")
        if self.init_error is not None:
            raise NVMLError(self.init_error)

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        if not 0 <= i < len(self.gpus):
            raise NVMLError(2)  # NVML_ERROR_INVALID_ARGUMENT
        return i

    def nvmlDeviceGetHandleByUUID(self, uuid):
        for i, g in enumerate(self.gpus):
            if g.uuid == (uuid.decode() if isinstance(uuid, bytes) else uuid):
                return i
        raise NVMLError(6)  # NVML_ERROR_NOT_FOUND

    def nvmlDeviceGetIndex(self, handle):
        return handle

    def nvmlDeviceGetName(self, handle):
        return self._gpu(handle).name

    def nvmlDeviceGetUUID(self, handle):
        return self._gpu(handle).uuid

    def nvmlDeviceGetMinorNumber(self, handle):
        return 10 + handle  # not the index: the device node's number is the driver's own

    def nvmlDeviceGetMemoryInfo(self, handle):
        g = self._gpu(handle)
        return types.SimpleNamespace(total=g.total, used=g.used, free=g.total - g.used)

    def nvmlDeviceGetUtilizationRates(self, handle):
        return types.SimpleNamespace(gpu=self._need(self._gpu(handle).util), memory=0)

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return self._need(self._gpu(handle).temp)

    def nvmlDeviceGetTotalEccErrors(self, handle, error_type, counter_type):
        assert (error_type, counter_type) == (1, 0)  # uncorrected, volatile
        return self._need(self._gpu(handle).ecc)

    def nvmlEventSetCreate(self):
        return "event-set"

    def nvmlDeviceGetSupportedEventTypes(self, handle):
        return 0x8 | 0x4 if self._gpu(handle).xid else 0x4

    def nvmlDeviceRegisterEvents(self, handle, types_, event_set):
        assert types_ == 0x8 and event_set == "event-set"
        self.registered.add(handle)

    def nvmlEventSetWait_v2(self, event_set, timeout_ms):
        assert timeout_ms == 0, "the heartbeat must never block on NVML events"
        pending = [p for p in self.pending if p[0] in self.registered]
        if not pending:
            raise NVMLError(NVML_ERROR_TIMEOUT)
        self.pending.remove(pending[0])
        index, xid = pending[0]
        return types.SimpleNamespace(device=index, eventType=0x8, eventData=xid)


def node(n: int = 4, **kw) -> FakeNvml:
    return FakeNvml([Gpu(uuid=f"GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}", **kw) for i in range(n)])
