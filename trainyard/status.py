"""A job's statuses and which of them are final: the one list the control plane's model
(jobs/models/runs.py Job.Status), the CLI (trainyard/cli/watch.py) and the pages' JavaScript
(served by controlplane/context_processors.py into templates/base.html, read by static/js/util.js)
all take theirs from. Plain strings, no Django: the CLI imports this without the control plane."""
from __future__ import annotations

QUEUED = "QUEUED"
STARTING = "STARTING"
RUNNING = "RUNNING"
STOPPING = "STOPPING"
SUCCEEDED = "SUCCEEDED"
FAILED = "FAILED"
CANCELLED = "CANCELLED"

# Every status, in the order the model's choices (and so its migrations) list them.
STATUSES: tuple[str, ...] = (QUEUED, STARTING, RUNNING, STOPPING, SUCCEEDED, FAILED, CANCELLED)
# An attempt holds slots: the job has started and not yet ended.
ACTIVE: tuple[str, ...] = (STARTING, RUNNING, STOPPING)
# The job has ended and will not move again (short of a rollback, which requeues it).
TERMINAL: tuple[str, ...] = (SUCCEEDED, FAILED, CANCELLED)
