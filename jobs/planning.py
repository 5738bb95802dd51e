"""The control plane's door to the planner (jobs/policy/plan): which constants a device type is
planned with, and one call from a parsed JSON request to the planner's output document. Used by
`POST /api/v1/plan/` (jobs/api_plan.py) and `python manage.py plan`.
"""
from __future__ import annotations

from .policy.plan import DEFAULT_CPU, DEFAULT_GPU, DeviceConstants, parse_plan_request, plan


def constants_for(device_name: str) -> DeviceConstants:
    """The constants to plan `device_name` with: for now DEFAULT_CPU for "cpu" and DEFAULT_GPU
    (fit on published runs) for any other name. The one place to read the newest calibration of
    that device type once one is stored."""
    return DEFAULT_CPU if device_name.strip().lower() == "cpu" else DEFAULT_GPU


def plan_document(data) -> dict:
    """The planner's output for a request (parsed JSON); PlanInputError naming each bad field."""
    req = parse_plan_request(data)
    return plan(req, constants_for(req.cluster.device.name))
