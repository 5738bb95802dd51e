"""Cooperative preemption: the contract between the control plane and the ranks (torch-free).

The control plane sets `trainyard.keys.preempt_key(attempt)` in Redis to a
trainyard.launch.PreemptRequest (jobs.core.dispatch.request_preempt: preemption, and any other stop
it asks of a running attempt). Every rank's reporter thread polls it (at most every POLL_S, off
the training thread); the ranks agree on it with an all_reduce on a gloo group of their own
about every 50 ms (stopvote.py `StopVote`, so all stop after the same step), save a checkpoint of
that step, wait for it to be complete and exit with PREEMPTED_EXIT_CODE. If they do not within
the grace period, the control plane stops them.
"""
from __future__ import annotations

PREEMPTED_EXIT_CODE = 83  # distinct from errors (1), signals (128+n) and torchrun's own codes
# A fenced attempt (the request's `fenced`: written off with a lost node, the job restarted
# elsewhere) exits with this at once, from the reporter thread, without a checkpoint: whatever
# it would still write is stale (reporter.py).
FENCED_EXIT_CODE = 84
POLL_S = 0.5  # a preemption request is seen within half a second plus one step
