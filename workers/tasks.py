"""Node-queue Celery tasks (`node.<name>`, served by the node agent): validate the message with
its trainyard.launch model and hand it to the agent, which owns the launcher. Reports go the
other way by task name (workers.agent), so this module knows nothing of the control plane."""
from __future__ import annotations

from trainyard.calibration import HARNESS_TIMEOUT_S, HarnessFailed, run_harness
from trainyard.launch import (CALIBRATION_REPORT_TASK, NODE_CALIBRATE_TASK, NODE_LAUNCH_TASK, NODE_STOP_TASK,
                              CalibrateRequest, CalibrationReport, Launch, Stop)

from .celery_app import app


# shared=False: registered with this side's app only (Celery shares tasks with every app in a
# process by default), so each side serves exactly its own queue's tasks even when both load.


# Every command is a Signed envelope sealed by the control plane with this node's credential
# (jobs.core.dispatch.sealed); Agent.command_open returns its body, or None (refused and logged).


@app.task(name=NODE_LAUNCH_TASK, shared=False, time_limit=180, acks_late=False)
def node_launch(envelope: dict) -> bool:
    from . import agent

    payload = agent.AGENT.command_open(envelope, NODE_LAUNCH_TASK)
    return payload is not None and agent.AGENT.launch(Launch.model_validate(payload))


@app.task(name=NODE_STOP_TASK, shared=False, time_limit=60, acks_late=False)
def node_stop(envelope: dict) -> None:
    from . import agent

    body = agent.AGENT.command_open(envelope, NODE_STOP_TASK)
    if body is not None:
        stop = Stop.model_validate(body)
        agent.AGENT.stop(stop.attempt_id, stop.reason)


@app.task(name=NODE_CALIBRATE_TASK, shared=False, time_limit=HARNESS_TIMEOUT_S[False] + 120, acks_late=False)
def node_calibrate(envelope: dict) -> bool:
    """Run the calibration harness on this node (a subprocess with a timeout, in a worker thread:
    launches and stops keep being served) and report its document, or its failure, to the
    control queue. True when measurements were sent."""
    import sys
    import time
    from pathlib import Path

    from . import agent

    payload = agent.AGENT.command_open(envelope, NODE_CALIBRATE_TASK)
    if payload is None:
        return False
    req = CalibrateRequest.model_validate(payload)
    node = agent.AGENT.name
    t0 = time.monotonic()
    report = CalibrationReport(node=node, requested_by=req.requested_by)
    try:
        doc, _ = run_harness(quick=req.quick, python=sys.executable, cwd=str(Path(__file__).resolve().parents[1]))
        report.measurements = doc
    except HarnessFailed as e:
        report.error = str(e)[-4000:]
    report.wall_s = time.monotonic() - t0
    agent.AGENT.report(CALIBRATION_REPORT_TASK, report.model_dump(mode="json"))
    return report.measurements is not None
