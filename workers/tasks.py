"""Thin Celery tasks. `control` queue: parse, call one jobs.services function (imported lazily:
node agents load this module too and never touch Django). `node.<name>` queues: hand over to
the agent, which owns the launcher."""
from __future__ import annotations

import logging

from .celery_app import app

log = logging.getLogger(__name__)

# ------------------------------------------------------------ control queue (control worker)


@app.task(name="workers.tasks.schedule_tick", time_limit=60, soft_time_limit=50)
def schedule_tick() -> list[int]:
    from jobs import services

    return services.schedule_tick()


@app.task(name="workers.tasks.nodes_check", time_limit=60, soft_time_limit=50)
def nodes_check() -> list[str]:
    from jobs import services

    return services.nodes_check()


@app.task(name="workers.tasks.eta_refresh", time_limit=60, soft_time_limit=50)
def eta_refresh() -> int:
    from jobs import services

    return services.eta_refresh()


@app.task(name="workers.tasks.attempts_check", time_limit=60, soft_time_limit=50)
def attempts_check() -> dict:
    from jobs import services

    return services.attempts_check()


@app.task(name="workers.tasks.node_heartbeat", time_limit=30, expires=10)
def node_heartbeat(payload: dict) -> None:
    from jobs import dispatch, services

    node, orphans = services.node_heartbeat(payload)
    for attempt_id in orphans:
        # The agent runs an attempt the control plane has already ended: stop it there.
        dispatch.send_stop(node.name, 0, attempt_id, "orphan")


@app.task(name="workers.tasks.attempt_ranks", time_limit=30)
def attempt_ranks(attempt_id: int, node: str, ranks: list) -> None:
    from jobs import services

    services.attempt_ranks(int(attempt_id), node_name=str(node), ranks=ranks)


@app.task(name="workers.tasks.attempt_node_exit", time_limit=30)
def attempt_node_exit(attempt_id: int, node: str, result: dict) -> None:
    from jobs import services

    services.attempt_node_exit(int(attempt_id), node_name=str(node), result=result)


# ------------------------------------------------------------ node queues (node agents)


@app.task(name="workers.tasks.node_launch", time_limit=180, acks_late=False)
def node_launch(payload: dict) -> bool:
    from . import agent

    return agent.AGENT.launch(payload)


@app.task(name="workers.tasks.node_stop", time_limit=60, acks_late=False)
def node_stop(job_id: int, attempt_id: int, reason: str) -> None:
    from . import agent

    agent.AGENT.stop(int(attempt_id), str(reason))
