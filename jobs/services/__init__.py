"""Every write and state transition of the control plane. Views, the API, consumers, tasks and the
relay call these functions, never the ORM's writes directly.

Transitions are compare-and-set (`filter(status=old).update(...)`), each writes a JobEvent, and
side effects (Celery sends, websocket messages) run only after commit. One module per topic,
each importing only the ones below it:

    jobs         submit, cancel, rollback, apply a recommendation  (what users ask for)
    scheduling   schedule_tick, eta_refresh, launching a placement
    ingest       telemetry_ingest, runtime events
    quotas       quotas_update, quota_audit
    nodes        heartbeats, rank/exit reports, nodes_check, drain/cordon/clear
    attempts     stop, preempt, finish and its outcome, hang/straggler/profile checks
    knowledge    the knowledge base: one record per ended attempt with enough warm steps
    profiling    the running attempt's profile (what bounds its step, the recommendation)
    checkpoints  register, reconcile, retention, resume point, pin
    busaccess    each attempt's own bus credentials: its Redis user and the secrets its Launch carries
    events       job events, the status compare-and-set, their publication
    bundles      code bundles: store, the submit check (bundle_files), garbage collection
    calibration  calibrations: request one of a node, store a report's fit, the newest constants

This module is the package's public API: `services.job_submit(user=..., spec=...)`.
"""
from __future__ import annotations

from jobs.services.attempts import attempt_preempt, attempts_check
from jobs.services.busaccess import attempt_access_reconcile
from jobs.services.bundles import bundle_delete, bundle_files, bundle_store, bundles_gc
from jobs.services.calibration import calibration_report, calibration_request, calibration_store
from jobs.services.checkpoints import checkpoint_pin, checkpoint_register, checkpoint_verify, checkpoints_reconcile
from jobs.services.identity import node_add, report_open, security_event
from jobs.services.ingest import telemetry_ingest, telemetry_owners
from jobs.services.jobs import job_apply_recommendation, job_cancel, job_rollback, job_submit
from jobs.services.nodes import attempt_node_exit, attempt_ranks, node_clear, node_heartbeat, node_set_schedulable, nodes_check
from jobs.services.quotas import quota_audit, quotas_update
from jobs.services.scheduling import eta_refresh, launches_resend_due, schedule_tick

__all__ = [
    "attempt_node_exit", "attempt_preempt", "attempt_ranks", "attempts_check", "bundle_delete", "bundle_files",
    "bundle_store", "bundles_gc", "calibration_report", "calibration_request", "calibration_store",
    "checkpoint_pin", "checkpoint_verify", "telemetry_owners",
    "checkpoint_register", "checkpoints_reconcile", "eta_refresh", "job_apply_recommendation", "job_cancel",
    "job_rollback", "attempt_access_reconcile",
    "job_submit", "launches_resend_due", "node_add", "node_clear", "node_heartbeat", "node_set_schedulable",
    "nodes_check", "quota_audit", "quotas_update", "report_open", "schedule_tick", "security_event", "telemetry_ingest",
]
