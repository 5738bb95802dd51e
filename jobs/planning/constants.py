"""The control plane's door to the planner (trainyard/plan): which constants a device type is
planned with, and one call from a parsed JSON request to the planner's output document. Used by
`POST /api/v1/plan/` (jobs/planning/api.py) and `python manage.py plan`.
"""
from __future__ import annotations

from jobs.models import Calibration
from trainyard.plan import DEFAULT_CPU, DEFAULT_GPU, DeviceConstants, parse_plan_request, plan


def latest_calibration(device_name: str) -> Calibration | None:
    """The newest calibration of this device type (`python manage.py calibrate`, or the knowledge
    page's staff button), None when it was never calibrated."""
    return Calibration.objects.filter(device_name=device_name.strip()).order_by("-id").first()


def constants_for(device_name: str) -> DeviceConstants:
    """The constants to plan `device_name` with: its newest calibration's, else DEFAULT_CPU for
    "cpu" and DEFAULT_GPU (fit on published runs) for any other name."""
    row = latest_calibration(device_name)
    if row is not None:
        return DeviceConstants.from_dict(row.constants)
    return default_constants(device_name)


def default_constants(device_name: str) -> DeviceConstants:
    """The uncalibrated constants: DEFAULT_CPU for "cpu", DEFAULT_GPU for any other name."""
    return DEFAULT_CPU if device_name.strip().lower() == "cpu" else DEFAULT_GPU


def peak_for(device_name: str) -> float | None:
    """The peak TFLOP/s a calibration's GEMM efficiencies are relative to (its best measured
    GEMM), None without a calibration: a calibrated device must be planned with this peak, or
    every compute time is off by the ratio of the peaks."""
    row = latest_calibration(device_name)
    return float(row.peak_tflops) if row is not None and row.peak_tflops else None


def plan_document(data) -> dict:
    """The planner's output for a request (parsed JSON); PlanInputError naming each bad field."""
    req = parse_plan_request(data)
    return plan(req, constants_for(req.cluster.device.name))
