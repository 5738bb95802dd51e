"""Calibrations: fit the cost model's constants to a node's measurements, evaluate them on
held-out runs against the defaults, store the row; the newest constants per device type.

The measurements come from `python -m workers.calibrate` (run by `manage.py calibrate` on this
machine, or by a node's agent for a staff request, reported back through a control-queue task).
"""
from __future__ import annotations

import dataclasses
import logging
from functools import partial

from django.contrib.auth import get_user_model
from django.db import transaction

from trainyard.calibration import MeasurementsError, parse_measurements
from trainyard.launch import CalibrationReport

from jobs.core import dispatch
from jobs.core.dbtext import text_problem
from jobs.core.errors import Conflict, InvalidInput, NotFound
from jobs.models import Allocation, Calibration, Node
from trainyard.plan.calibration import evaluate, fit, held_out_split, peak_of
from trainyard.plan.constants import DEFAULT_CPU, DEFAULT_GPU, DeviceConstants
from trainyard.plan.job import KIND_DEFAULTS

log = logging.getLogger(__name__)
HELD_OUT_EVERY = 3  # every third run (1, 4, 7, ...) is held out of the fit and evaluated


def calibration_fit(measurements: dict) -> tuple[DeviceConstants, dict]:
    """(constants fit on the runs not held out, {"held_out", "before", "after"}); InvalidInput
    naming the fields of a bad document."""
    try:
        m = parse_measurements(measurements)
    except MeasurementsError as e:
        raise InvalidInput({f"measurements.{k}": v for k, v in e.errors.items()}) from None
    base = DEFAULT_GPU if m.device.kind == "cuda" else DEFAULT_CPU
    base = dataclasses.replace(base, name=m.device.name)
    doc = m.model_dump()
    fit_idx, held = held_out_split(len(m.runs), HELD_OUT_EVERY)
    if len(m.runs) < 3:  # too few to hold any out: fit and evaluate on all (said in the evaluation)
        fit_idx, held = list(range(len(m.runs))), list(range(len(m.runs)))
    constants = fit(doc, base, runs=fit_idx)
    # before: what the planner predicts for this device kind today (its default constants and the
    # device facts job.py assumes); after: the fit, its efficiencies relative to the measured peak
    default_peak = KIND_DEFAULTS[m.device.kind]["peak_tflops"]
    evaluation = {"held_out": held, "fit_runs": fit_idx, "peak_tflops": peak_of(m),
                  "before": evaluate(doc, base, held, peak_tflops=default_peak),
                  "after": evaluate(doc, constants, held)}
    return constants, evaluation


def calibration_store(measurements: dict, *, node: str, user=None) -> Calibration:
    """Fit, evaluate and store one calibration (calibration_fit); returns the row."""
    constants, evaluation = calibration_fit(measurements)
    device = measurements["device"]
    return Calibration.objects.create(
        device_name=device["name"], kind=device["kind"], node=node[:200],
        peak_tflops=evaluation["peak_tflops"], constants=constants.to_dict(),
        measurements=measurements, evaluation=evaluation, created_by=user)


def calibration_request(node_name: object, *, quick: object = False, user) -> Node:
    """Ask a node's agent to calibrate (NODE_CALIBRATE_TASK, sent after commit); the result comes
    back as a CalibrationReport (calibration_report). The node must be READY and idle: the harness
    uses its cores, and a job beside it would distort both."""
    if not isinstance(node_name, str) or not node_name:
        raise InvalidInput({"node": ["a node name is required"]})
    if why := text_problem(node_name):
        raise InvalidInput({"node": [why]})
    if not isinstance(quick, bool):
        raise InvalidInput({"quick": ["must be true or false"]})
    node = Node.objects.filter(name=node_name).first()
    if node is None:
        raise NotFound({"node": [f"no node named {node_name!r}"]})
    if node.status != Node.Status.READY:
        raise Conflict({"node": [f"node {node.name} is {node.status}, not READY"]})
    if Allocation.objects.filter(node=node, active=True).exists():
        raise Conflict({"node": [f"node {node.name} is running jobs: calibrate it when it is idle"]})
    transaction.on_commit(partial(dispatch.send_calibrate, node.name, quick=quick,
                                  requested_by=getattr(user, "pk", None)))
    log.info("calibration of node %s requested by %s (quick=%s)", node.name, user, quick)
    return node


def calibration_report(report: CalibrationReport) -> Calibration | None:
    """A node's CalibrationReport (validated at the edge): store the calibration; a failed harness
    or invalid measurements are logged (nothing stored) and return None."""
    if report.measurements is None:
        log.warning("calibration of node %s failed: %s", report.node, report.error or "no measurements")
        return None
    user = get_user_model().objects.filter(pk=report.requested_by).first() if report.requested_by else None
    try:
        return calibration_store(report.measurements, node=report.node, user=user)
    except InvalidInput as e:
        log.warning("calibration of node %s sent invalid measurements: %s", report.node, e)
        return None
