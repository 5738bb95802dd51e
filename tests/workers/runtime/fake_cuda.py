"""CUDA's timing events, faked at torch.cuda's boundary for CPU tests.

A real event's time is when the device reaches it, and `elapsed_time` is valid only once both
events have completed (after a synchronize; before, CUDA raises "device not ready"). The fake
device runs everything at once, so an event completes at its record time (perf_counter), but
`elapsed_time` raises until `torch.cuda.synchronize()` has run after both records: code that
resolves a mark before synchronising fails here as it would on a GPU. Marks are objects, not
floats, as CUDA events are.
"""
from __future__ import annotations

import time

import torch


class FakeStream:
    def __init__(self, name: str):
        self.name = name


MAIN = FakeStream("main")


class FakeCuda:
    def __init__(self):
        self.current = MAIN
        self.syncs = 0
        self.generation = 0  # synchronize() calls so far: an event completes at the next one

    def event_class(self):
        cuda = self

        class Event:
            def __init__(self, enable_timing: bool = False):
                if not enable_timing:
                    raise RuntimeError("fake CUDA: this event was made without enable_timing")
                self.t = None
                self.stream = None

            def record(self, stream=None):
                self.t, self.recorded_in = time.perf_counter(), cuda.generation
                self.stream = stream or cuda.current

            def elapsed_time(self, end: "Event") -> float:
                for ev in (self, end):
                    if ev.t is None or ev.recorded_in >= cuda.generation:
                        raise RuntimeError("fake CUDA: device not ready (elapsed_time before "
                                           "synchronize)")
                return (end.t - self.t) * 1000.0

        return Event

    def synchronize(self, device=None):
        self.syncs += 1
        self.generation += 1

    def current_stream(self, device=None):
        return self.current


def install(monkeypatch) -> FakeCuda:
    """Replace torch.cuda's Event, synchronize and current_stream for this test."""
    cuda = FakeCuda()
    monkeypatch.setattr(torch.cuda, "Event", cuda.event_class())
    monkeypatch.setattr(torch.cuda, "synchronize", cuda.synchronize)
    monkeypatch.setattr(torch.cuda, "current_stream", cuda.current_stream)
    return cuda
