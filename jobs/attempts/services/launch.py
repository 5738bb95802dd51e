"""Starting an attempt: its row, its allocations, the Launch each node gets (sealed after commit), and sending them again when no rank reported.
"""
from __future__ import annotations

from typing import TYPE_CHECKING
from datetime import timedelta
from functools import partial
from django.conf import settings
from django.db import transaction
from django.utils import timezone
from trainyard import keys, redis_acl
from trainyard.launch import Launch, Resume
from trainyard.backends import Gang
from jobs.core import dispatch
from jobs.core.agents_backend import AGENTS
from jobs.models import Allocation, Attempt, Job, Node
from jobs.attempts.policy import diagnosis
from jobs.attempts.services.busaccess import attempt_access_grant, attempt_secrets
from jobs.attempts.services.checkpoints import checkpoints_reconcile, resume_checkpoint
from jobs.attempts.services.elastic import elastic_started, spec_at
from jobs.attempts.services.events import job_event, job_set_status


if TYPE_CHECKING:  # the decision it applies; only the scheduler's tick calls this
    from jobs.scheduling import policy as scheduling


def launch_payload(job: Job, attempt: Attempt, alloc: Allocation, *, rdzv_host: str, nnodes: int,
                   local_addr: str) -> dict:
    """The Launch message of one node's share of an attempt, from what the database holds (so the
    launch can be sent again, identical, by `launch_resend`)."""
    resume = attempt.resumed_from
    secrets = attempt_secrets(attempt)
    return Launch(
        job_id=job.pk, attempt_id=attempt.pk, node=alloc.node.name, node_rank=alloc.node_rank,
        nnodes=nnodes, nproc=len(alloc.slot_ids), slots=list(alloc.slot_ids),
        device=job.spec["resources"]["device"], rdzv_host=rdzv_host, local_addr=local_addr,
        stream=keys.attempt_stream(job.pk, attempt.pk), redis_user=redis_acl.attempt_user(attempt.pk),
        redis_password=secrets.redis_password, proof_key=secrets.proof_key, rdzv_token=secrets.rdzv_token,
        spec=spec_at(job.spec, nnodes, job.plan), planner=(job.plan or {}).get("auto_inputs"),
        collective_timeout_s=diagnosis.collective_timeout(job.spec.get("hang_timeout_s", "auto"),
                                                          settings.TRAINYARD_HANG_FLOOR_S),
        resume=Resume(path=resume.path, step=resume.step, checkpoint_id=resume.pk) if resume else None,
        memory_limit_gb=(settings.TRAINYARD_CPU_DEVICE_MEMORY_GB if settings.TRAINYARD_CPU_DEVICE_MEMORY_ENFORCE
                         and job.spec["resources"]["device"] == "cpu" else None),
    ).model_dump(mode="json")


def launches_resend_due() -> int:
    """launch_resend for every STARTING attempt older than TRAINYARD_LAUNCH_RESEND_S and younger
    than the launch timeout (run with nodes_check, every few seconds); returns how many."""
    now = timezone.now()
    due = (Attempt.objects.filter(status=Attempt.Status.STARTING, stop_reason="", slurm__isnull=True,
                                  created_at__lt=now - timedelta(seconds=settings.TRAINYARD_LAUNCH_RESEND_S),
                                  created_at__gte=now - timedelta(seconds=settings.TRAINYARD_LAUNCH_TIMEOUT_S))
           .exclude(events__kind="launch_resent").select_related("job", "resumed_from"))
    count = 0
    with transaction.atomic():
        for attempt in due:
            launch_resend(attempt)
            count += 1
    return count


def launch_resend(attempt: Attempt) -> None:
    """Send an attempt's launches again, once (recorded as its `launch_resent` event). A control
    worker killed between the tick's commit and its on_commit sends left a STARTING attempt that
    no agent ever heard of, failed 120 s later as a launch timeout blamed on a node. Agents ignore
    a launch they already have (their run directory's `launched` marker), so a resend is harmless
    where the first one did arrive."""
    if attempt.events.filter(kind="launch_resent").exists():
        return
    allocs = list(attempt.allocations.filter(active=True).select_related("node").order_by("node_rank"))
    if not allocs:
        return
    host = allocs[0].node.address
    attempt_access_grant(attempt)  # its user may have been lost with the first sends
    for alloc in allocs:
        payload = launch_payload(attempt.job, attempt, alloc, rdzv_host=host, nnodes=len(allocs),
                                 local_addr=alloc.node.address)
        transaction.on_commit(partial(dispatch.send_launch, alloc.node.name, payload))
    job_event(attempt.job, "launch_resent", f"attempt {attempt.number}: no rank had reported "
              f"{settings.TRAINYARD_LAUNCH_RESEND_S:.0f} s after the launch; sent it again",
              attempt=attempt, nodes=[a.node.name for a in allocs])


def attempt_start(placement: scheduling.Placement) -> bool:
    job = Job.objects.get(pk=placement.job_id)
    if not job_set_status(job, Job.Status.QUEUED, Job.Status.STARTING, "launching on "
                           + ", ".join(s.node for s in placement.shares)
                           + (" (borrowing idle capacity beyond its team's quota)" if placement.borrowing else ""),
                           borrowing=placement.borrowing, predicted_start_at=None):
        return False
    number = (job.attempts.order_by("-number").values_list("number", flat=True).first() or 0) + 1
    checkpoints_reconcile(job)
    resume = resume_checkpoint(job)
    attempt = Attempt.objects.create(
        job=job, number=number, resumed_from=resume,
        resumed_from_step=resume.step if resume else (0 if number > 1 else None))
    if number > 1:  # progress restarts where this attempt resumes; the charts rewind there too
        Job.objects.filter(pk=job.pk).update(step=attempt.resumed_from_step)
    nodes = {n.name: n for n in Node.objects.filter(name__in=[s.node for s in placement.shares])}
    attempt_access_grant(attempt)  # after commit, before the launches: the ranks' own Redis user
    # A pool's seats (a Slurm pool) have no agent yet: the scheduler's tick asks Slurm for the nodes
    # (jobs.fleet.services.slurm.gang_start) and the launches go out once their agents registered.
    deferred = any(n.pool_id is not None for n in nodes.values())
    launches = []
    for share in placement.shares:
        alloc = Allocation.objects.create(attempt=attempt, node=nodes[share.node], node_rank=share.node_rank,
                                          slot_ids=list(share.slot_ids))
        if not deferred:
            launches.append((share.node, launch_payload(job, attempt, alloc, rdzv_host=placement.shares[0].address,
                                                        nnodes=len(placement.shares), local_addr=share.address)))
    if not deferred:  # Trainyard's own agents: the launch backend sends each node its Launch after commit
        gang = Gang(job_id=job.pk, attempt_id=attempt.pk, nodes=len(launches),
                    procs_per_node=len(placement.shares[0].slot_ids), launches=tuple(launches))
        transaction.on_commit(partial(AGENTS.submit, gang))
    elastic_started(job, attempt, len(placement.shares), placement.reason)
    where = ", ".join(f"{s.node}[{','.join(map(str, s.slot_ids))}]" for s in placement.shares)
    origin = (f"resuming from the checkpoint at step {resume.step}" if resume
              else "from step 0 (no checkpoint yet)" if number > 1 else "")
    job_event(job, "attempt_started", f"attempt {number} placed on {where}" + (f", {origin}" if origin else ""),
           attempt=attempt, nodes=[s.node for s in placement.shares],
           resume_step=attempt.resumed_from_step, checkpoint=resume.pk if resume else None)
    return True
