"""Node-queue Celery tasks (`node.<name>`, served by the node agent): validate the message with
its trainyard.launch model and hand it to the agent, which owns the launcher. Reports go the
other way by task name (workers.agent), so this module knows nothing of the control plane."""
from __future__ import annotations

from trainyard.launch import NODE_LAUNCH_TASK, NODE_STOP_TASK, Launch, Stop

from .celery_app import app


# shared=False: registered with this side's app only (Celery shares tasks with every app in a
# process by default), so each side serves exactly its own queue's tasks even when both load.


@app.task(name=NODE_LAUNCH_TASK, shared=False, time_limit=180, acks_late=False)
def node_launch(payload: dict) -> bool:
    from . import agent

    return agent.AGENT.launch(Launch.model_validate(payload))


@app.task(name=NODE_STOP_TASK, shared=False, time_limit=60, acks_late=False)
def node_stop(job_id: int, attempt_id: int, reason: str) -> None:
    from . import agent

    stop = Stop(job_id=job_id, attempt_id=attempt_id, reason=reason)
    agent.AGENT.stop(stop.attempt_id, stop.reason)
