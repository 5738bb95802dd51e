"""What the agents report about attempts: every rank of an attempt up on a node, and its processes there having exited (signed by the node holding the allocation).
"""
from __future__ import annotations
from django.db import transaction
from django.utils import timezone
from trainyard.launch import NodeExit, RankInfo
from jobs.fleet.services.nodes import quarantine_if_blamed
from jobs.core.dbtext import storable
from jobs.models import Allocation, Attempt, Job
from jobs.attempts.services.attempts import attempt_maybe_finish, attempt_stop
from jobs.attempts.services.events import job_event, job_set_status
from jobs.fleet.services.identity import security_event


def _foreign(attempt_id: int, node_name: str, what: str) -> bool:
    """True (and a security event) if the attempt exists but `node_name` holds no allocation of it:
    a node reporting for another node's allocation. False for a duplicate report from its owner."""
    if Allocation.objects.filter(attempt_id=attempt_id, node__name=node_name).exists():
        return False
    if not Attempt.objects.filter(pk=attempt_id).exists():
        return False
    security_event("foreign_allocation", node_name, f"{what} for attempt {attempt_id}, which has no allocation "
                                                    f"on {node_name}")
    return True


def _locked(attempt_id: int) -> Attempt:
    """The attempt, its row locked until the transaction ends, taken after the reporting node's own
    allocation was written (allocation, then attempt: the order nodes_check locks them in). Two
    nodes' reports of one attempt then judge "every node has reported" one after the other, the
    second seeing the first's committed allocation. Without it, on PostgreSQL (read committed) two
    reports handled at once each saw the other's allocation unchanged: an attempt whose ranks all
    started stayed STARTING until its launch timed out, and one whose nodes all exited stayed
    RUNNING until the hang detector stopped it (SQLite serialises the writers, so never there)."""
    return Attempt.objects.select_for_update(of=("self",)).select_related("job").get(pk=attempt_id)


def attempt_ranks(attempt_id: int, *, node_name: str, ranks: list[dict]) -> None:
    """A node reports the ranks it started (rank, local_rank, pid); once every node did, the
    attempt and its job are RUNNING."""
    with transaction.atomic():
        alloc = Allocation.objects.filter(attempt_id=attempt_id, node__name=node_name).select_related(
            "attempt__job").first()
        if alloc is None:
            _foreign(attempt_id, node_name, "rank report")
            return
        infos = [RankInfo.model_validate(r) for r in ranks]
        Allocation.objects.filter(pk=alloc.pk).update(
            ranks=sorted(({"rank": r.rank, "local_rank": r.local_rank, "pid": r.pid} for r in infos),
                         key=lambda r: r["rank"]))
        attempt = _locked(alloc.attempt_id)
        waiting = Allocation.objects.filter(attempt=attempt, ranks=[]).exists()
        if waiting:
            return
        if Attempt.objects.filter(pk=attempt.pk, status=Attempt.Status.STARTING).update(
                status=Attempt.Status.RUNNING, started_at=timezone.now()):
            job = attempt.job
            if job_set_status(job, Job.Status.STARTING, Job.Status.RUNNING, ""):
                job_event(job, "running", f"attempt {attempt.number}: all ranks started", attempt=attempt)


def attempt_node_exit(attempt_id: int, *, node_name: str, result: dict) -> None:
    """A node's processes for an attempt have exited (or were stopped, or never started).
    `result` is a NodeExit's JSON, stored as it came (the evidence diagnosis reads), NULs in its
    log tails made storable on PostgreSQL (jobs/core/dbtext.py)."""
    result = storable(result)
    report = NodeExit.model_validate(result)
    if report.node is not None and report.node != node_name:
        security_event("foreign_allocation", node_name, f"exit report for attempt {attempt_id} names node "
                                                        f"{report.node[:64]}")
        return
    with transaction.atomic():
        alloc = Allocation.objects.filter(attempt_id=attempt_id, node__name=node_name, active=True).select_related(
            "attempt", "node").first()
        if alloc is None:
            _foreign(attempt_id, node_name, "exit report")
            return  # duplicate report, or the node was already written off as lost
        Allocation.objects.filter(pk=alloc.pk).update(active=False, result=result, ended_at=timezone.now())
        attempt = _locked(alloc.attempt_id)
        failed = report.exit_code != 0 and not report.stopped
        if failed and attempt.status != Attempt.Status.ENDED and not attempt.stop_reason:
            attempt_stop(attempt, reason="failure")
        else:
            attempt_maybe_finish(attempt)
        quarantine_if_blamed(attempt)
