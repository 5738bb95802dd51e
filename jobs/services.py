"""Every write and state transition of the control plane. Views, the API, consumers, tasks and the
relay call these functions, never the ORM's writes directly.

Transitions are compare-and-set (`filter(status=old).update(...)`), each writes a JobEvent, and
side effects (Celery sends, websocket messages) run only after commit. Each domain keeps its
own services (jobs/<domain>/services*): runs (submit, cancel, apply a recommendation),
scheduling (the tick, ETAs, quotas), telemetry (ingest), fleet (heartbeats, reports, identity,
nodes_check), attempts (launch, rollback, stop/preempt/finish, profiling, adapt auto's tuning, checkpoints, bus access,
events), planning (knowledge, calibration) and bundles. Which may import which is written once,
in pyproject.toml's import-linter contracts ("jobs: the domains, each importing only the ones
below it", and one per domain's services); docs/architecture.md section 2 explains it.

This module is the package's public API: `services.job_submit(user=..., spec=services.submitted_spec(data))`.
"""
from __future__ import annotations

from jobs.attempts.services.attempts import attempt_preempt, attempts_check
from jobs.attempts.services.busaccess import attempt_access_reconcile
from jobs.bundles.services import bundle_delete, bundle_files, bundle_store, bundles_gc
from jobs.planning.services.calibration import calibration_report, calibration_request, calibration_store
from jobs.attempts.services.checkpoints import checkpoint_pin, checkpoint_register, checkpoint_verify, checkpoints_reconcile
from jobs.fleet.services.identity import node_add, report_open, security_event
from jobs.telemetry.ingest import telemetry_ingest, telemetry_owners
from jobs.telemetry.retention import telemetry_purge
from jobs.telemetry.retention_settings import retention_update
from jobs.runs.services import job_apply_recommendation, job_cancel, job_submit, submitted_spec
from jobs.attempts.services.rollback import job_rollback
from jobs.attempts.services.tuning import attempts_tune
from jobs.fleet.services.reports import attempt_node_exit, attempt_ranks
from jobs.fleet.services.nodes import node_clear, node_heartbeat, node_set_schedulable, nodes_check
from jobs.fleet.services.slurm import gang_submit as slurm_gang_submit
from jobs.fleet.services.slurm import seat_draining as slurm_seat_draining
from jobs.fleet.services.slurm import seat_up as slurm_seat_up
from jobs.fleet.services.slurm import slurm_poll, slurm_reconcile
from jobs.scheduling.services.quotas import quota_audit, quotas_update
from jobs.scheduling.services.tick import eta_refresh, schedule_tick
from jobs.attempts.services.launch import launches_resend_due
from jobs.experiments.services import (experiment_stop, experiment_submit, experiments_advance,
                                      trial_continue)
from jobs.notify.services import delivery_try, notify_event, notify_fanout

__all__ = [
    "attempt_node_exit", "attempt_preempt", "attempt_ranks", "attempts_check", "attempts_tune", "bundle_delete", "bundle_files",
    "bundle_store", "bundles_gc", "calibration_report", "calibration_request", "calibration_store",
    "checkpoint_pin", "checkpoint_verify", "telemetry_owners",
    "checkpoint_register", "checkpoints_reconcile", "eta_refresh", "job_apply_recommendation", "job_cancel",
    "job_rollback", "attempt_access_reconcile",
    "job_submit", "launches_resend_due", "node_add", "node_clear", "node_heartbeat", "node_set_schedulable",
    "nodes_check", "quota_audit", "quotas_update", "report_open", "schedule_tick", "security_event", "submitted_spec",
    "slurm_gang_submit", "slurm_poll", "slurm_reconcile", "slurm_seat_draining", "slurm_seat_up",
    "telemetry_ingest", "telemetry_purge", "retention_update", "experiment_stop", "experiment_submit", "experiments_advance", "trial_continue",
    "delivery_try", "notify_event", "notify_fanout",
]
