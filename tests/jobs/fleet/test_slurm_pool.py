"""Slurm pools in the control plane (issue 27), with a recording backend in place of Slurm (the real
slurmctld/slurmd run in tests/integration/test_slurm_jobs.py): seats, the tick's submit, the seats'
allocation-bound credentials, launches once every agent registered, Slurm's pending reason on the
job, ends before and after the agents registered, releases, and Slurm's SIGTERM as a preemption."""
from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.utils import timezone

from jobs import services, tasks
from jobs.core import dispatch
from jobs.fleet.services import slurm
from jobs.fleet.services.identity import master_key
from jobs.fleet.services.pools import seats_sync
from jobs.models import Attempt, Job, Node, Pool, SecurityEvent, SlurmJob
from trainyard import backends, nodeauth
from trainyard.backends import Handle, HandleStatus, State
from trainyard.launch import HEARTBEAT_TASK

from tests.jobs.runs.test_services import submit

pytestmark = pytest.mark.django_db


class FakeBackend:
    """Records calls; status answers what the test put in `answers` (by Slurm job id)."""

    def __init__(self):
        self.name = "slurm:lab"
        self.calls: list[tuple] = []
        self.answers: dict[str, HandleStatus] = {}
        self.files: dict[str, str] = {}
        self.next_id = 100
        self.gangs: list = []
        self.bad: dict[str, tuple[str, str]] = {}
        self.refuse = ""

    def put_file(self, tag: str, name: str, data: str) -> str:
        path = f"/shared/ty/{tag}/{name}"
        self.files[path] = data
        return path

    def submit(self, gang):
        self.calls.append(("submit", gang.tag, gang.nodes, gang.command))
        self.gangs.append(gang)
        if self.refuse:
            raise backends.SubmitRefused(self.refuse)
        self.next_id += 1
        return Handle(self.name, str(self.next_id))

    def status(self, handles):
        self.calls.append(("status", tuple(h.id for h in handles)))
        return {h: self.answers.get(h.id, HandleStatus(State.UNKNOWN)) for h in handles}

    def cancel(self, handle, grace_s):
        self.calls.append(("cancel", handle.id, grace_s))

    def unhealthy_nodes(self, nodes):
        self.calls.append(("sinfo", tuple(nodes)))
        return {n: self.bad[n] for n in nodes if n in self.bad}

    def reconcile(self, live_tags):
        self.calls.append(("reconcile", frozenset(live_tags)))
        return backends.Reconciled()


@pytest.fixture
def fake(monkeypatch):
    backend = FakeBackend()
    monkeypatch.setattr(slurm, "backend_for", lambda pool: backend)
    submits = []
    monkeypatch.setattr(dispatch, "send_slurm_submit", lambda pk: submits.append(pk))
    monkeypatch.setattr(dispatch, "node_user_grant", lambda node, pw: backend.calls.append(("redis_user", node)))
    monkeypatch.setattr(dispatch, "node_users_revoke", lambda nodes: backend.calls.append(("redis_revoke", tuple(nodes))))
    backend.submits = submits
    return backend


@pytest.fixture
def pool(db):
    p = Pool.objects.create(name="lab", max_nodes=3, slots_per_node=1, settings={"partition": "batch"})
    seats_sync(p)
    return p


def on_pool(user, nodes=2, procs_per_node=1, **kw):
    return submit(user, resources={"nodes": nodes, "procs_per_node": procs_per_node, "pool": "lab"}, **kw)


def placed(user, fake, django_capture_on_commit_callbacks, **kw) -> SlurmJob:
    job = on_pool(user, **kw)
    with django_capture_on_commit_callbacks(execute=True):
        services.schedule_tick()
    sj = SlurmJob.objects.get(attempt__job=job)
    slurm.gang_submit(sj.pk)
    sj.refresh_from_db()
    return sj


def agents_up(sj: SlurmJob, django_capture_on_commit_callbacks, ranks: bool = False) -> None:
    """Both seats' agents of Slurm job 101 registered (so the launches went out), and with `ranks`
    the ranks reported (the attempt RUNNING)."""
    with django_capture_on_commit_callbacks(execute=True):
        tasks.node_heartbeat(seat_beat("lab-0", "101", "10.0.0.2"))
        tasks.node_heartbeat(seat_beat("lab-1", "101", "10.0.0.3"))
    if ranks:
        for alloc in Attempt.objects.get(pk=sj.attempt_id).allocations.select_related("node"):
            services.attempt_ranks(sj.attempt_id, node_name=alloc.node.name,
                                   ranks=[{"rank": alloc.node_rank, "local_rank": 0, "pid": 10}])


def seat_beat(seat: str, allocation: str, address: str, **extra) -> dict:
    """A heartbeat of the seat's ephemeral agent, signed with the credential minted for its allocation."""
    node = Node.objects.get(name=seat)
    credential = nodeauth.derive_credential(master_key(), seat, node.credential_salt)
    body = {"name": seat, "address": address, "slots": 1, "labels": {}, "agent_id": f"agent-{seat}",
            "allocation": allocation, **extra}
    return nodeauth.seal(credential, seat, HEARTBEAT_TASK, body, time.time())


def test_seats_run_only_their_pools_jobs(user, nodes, pool, fake, sent, django_capture_on_commit_callbacks):
    plain = submit(user, resources={"nodes": 2, "procs_per_node": 2})
    on_lab = on_pool(user)
    with django_capture_on_commit_callbacks(execute=True):
        services.schedule_tick()
    plain_nodes = set(Job.objects.get(pk=plain.pk).attempts.get().allocations.values_list("node__name", flat=True))
    lab_nodes = set(Job.objects.get(pk=on_lab.pk).attempts.get().allocations.values_list("node__name", flat=True))
    assert plain_nodes == {"node-a", "node-b"} and lab_nodes == {"lab-0", "lab-1"}
    # only the agents' job was launched; the pool's waits for Slurm
    assert {c[1] for c in sent if c[0] == "launch"} == {"node-a", "node-b"}
    assert fake.submits == [SlurmJob.objects.get().pk]


def test_a_job_the_pool_could_never_hold_or_an_unknown_pool_is_refused_at_submit(user, nodes, pool, fake, sent):
    from trainyard.rules import SpecError

    with pytest.raises(SpecError, match="pool lab has 3 node"):
        on_pool(user, nodes=4)
    with pytest.raises(SpecError, match="no pool named gpu; pools: lab"):
        submit(user, resources={"nodes": 1, "procs_per_node": 1, "pool": "gpu"})
    assert not Job.objects.exists()


def test_a_job_waits_while_the_pools_seats_are_held(user, pool, fake, sent, django_capture_on_commit_callbacks):
    placed(user, fake, django_capture_on_commit_callbacks)  # holds lab-0, lab-1
    second = on_pool(user)
    services.schedule_tick()
    second.refresh_from_db()
    assert second.status == "QUEUED" and not SlurmJob.objects.filter(attempt__job=second).exists()


def test_the_submit_mints_credentials_bound_to_the_allocation(user, pool, fake, sent, django_capture_on_commit_callbacks):
    sj = placed(user, fake, django_capture_on_commit_callbacks)
    assert (sj.state, sj.slurm_id, sj.seats) == ("pending", "101", ["lab-0", "lab-1"])
    seats = Node.objects.filter(name__in=sj.seats)
    assert all(n.holder_id == sj.pk and n.credential_digest for n in seats)
    assert ("redis_user", "lab-0") in fake.calls and ("redis_user", "lab-1") in fake.calls
    (path, data), = fake.files.items()
    assert path == f"/shared/ty/trainyard-{sj.attempt.job_id}-a{sj.attempt_id}/agents.json"
    assert "credential" in data and [c for c in fake.calls if c[0] == "submit"][0][3][-1] == path
    # idempotent: the submit task delivered twice submits once
    assert slurm.gang_submit(sj.pk) is None and len([c for c in fake.calls if c[0] == "submit"]) == 1


def test_a_refused_submit_is_a_placement_failure(user, pool, fake, sent, django_capture_on_commit_callbacks):
    fake.refuse = "sbatch: error: invalid partition specified: gpu"
    job = on_pool(user)
    with django_capture_on_commit_callbacks(execute=True):
        services.schedule_tick()
    slurm.gang_submit(SlurmJob.objects.get().pk)
    attempt = Attempt.objects.get(job=job)
    assert attempt.outcome == "failed:placement"
    assert "invalid partition" in attempt.failure["message"]
    job.refresh_from_db()
    assert job.status == "FAILED" and "invalid partition" in job.status_reason


def test_heartbeats_count_only_from_the_holding_slurm_job_and_launch_once_all_are_up(
        user, pool, fake, sent, django_capture_on_commit_callbacks):
    sj = placed(user, fake, django_capture_on_commit_callbacks)
    tasks.node_heartbeat(seat_beat("lab-0", "999", "10.0.0.9"))  # another Slurm job's agent
    assert Node.objects.get(name="lab-0").address == ""
    assert SecurityEvent.objects.filter(kind="allocation_mismatch", node="lab-0").exists()
    with django_capture_on_commit_callbacks(execute=True):
        tasks.node_heartbeat(seat_beat("lab-0", "101", "10.0.0.2"))
    assert not [c for c in sent if c[0] == "launch"]  # lab-1's agent is not up yet
    with django_capture_on_commit_callbacks(execute=True):
        tasks.node_heartbeat(seat_beat("lab-1", "101", "10.0.0.3"))
        tasks.node_heartbeat(seat_beat("lab-1", "101", "10.0.0.3"))
    launches = [c for c in sent if c[0] == "launch"]
    assert [(c[1], c[2]["rdzv_host"], c[2]["local_addr"]) for c in launches] == [
        ("lab-0", "10.0.0.2", "10.0.0.2"), ("lab-1", "10.0.0.2", "10.0.0.3")]
    sj.refresh_from_db()
    assert sj.launched_at is not None and sj.state == "running"


def test_slurms_pending_reason_shows_on_the_job(user, pool, fake, sent, django_capture_on_commit_callbacks):
    sj = placed(user, fake, django_capture_on_commit_callbacks)
    eta = time.time() + 3600
    fake.answers["101"] = HandleStatus(State.PENDING, reason="Priority", category="priority", eta=eta)
    slurm.slurm_poll()
    job = Job.objects.get(pk=sj.attempt.job_id)
    assert job.status == "STARTING"
    assert job.status_reason.startswith("Slurm job 101 pending: priority (Priority), expected start ")
    assert [c for c in fake.calls if c[0] == "status"] == [("status", ("101",))]


def test_no_answer_is_never_gone(user, pool, fake, sent, django_capture_on_commit_callbacks):
    sj = placed(user, fake, django_capture_on_commit_callbacks)
    for _ in range(3):
        slurm.slurm_poll()  # UNKNOWN each time
    sj.refresh_from_db()
    assert sj.state == "pending" and sj.unknown_since is not None and sj.attempt.status == "STARTING"
    SlurmJob.objects.filter(pk=sj.pk).update(unknown_since=timezone.now() - timedelta(seconds=slurm.UNKNOWN_GIVE_UP_S + 1))
    slurm.slurm_poll()
    assert Attempt.objects.get(pk=sj.attempt_id).outcome == "failed:placement"


def test_the_launch_timeout_waits_while_slurm_pends(user, pool, fake, sent, settings, healthy_control_plane,
                                                    django_capture_on_commit_callbacks):
    sj = placed(user, fake, django_capture_on_commit_callbacks)
    Attempt.objects.filter(pk=sj.attempt_id).update(created_at=timezone.now() - timedelta(hours=1))
    services.nodes_check()
    assert Attempt.objects.get(pk=sj.attempt_id).status == "STARTING"


def test_a_slurm_job_that_fails_before_its_agents_is_a_placement_failure(
        user, pool, fake, sent, django_capture_on_commit_callbacks):
    sj = placed(user, fake, django_capture_on_commit_callbacks, max_restarts=1)
    fake.answers["101"] = HandleStatus(State.FAILED, reason="NODE_FAIL", exit_code=1)
    slurm.slurm_poll()
    attempt = Attempt.objects.get(pk=sj.attempt_id)
    assert attempt.outcome == "failed:placement" and "NODE_FAIL" in attempt.failure["message"]
    job = Job.objects.get(pk=attempt.job_id)
    assert job.status == "QUEUED" and job.restarts == 1  # retried: a new attempt, a new Slurm job
    slurm.slurm_poll()  # the ended attempt's seats are released
    assert not Node.objects.filter(pool=pool).exclude(holder=None).exists()
    assert not Node.objects.filter(pool=pool).exclude(credential_digest="").exists()


def test_the_end_releases_the_seats_and_cancels_what_slurm_still_runs(
        user, pool, fake, sent, django_capture_on_commit_callbacks):
    sj = placed(user, fake, django_capture_on_commit_callbacks)
    agents_up(sj, django_capture_on_commit_callbacks)
    for seat in sj.seats:
        services.attempt_node_exit(sj.attempt_id, node_name=seat, result={
            "attempt_id": sj.attempt_id, "node": seat, "exit_code": 0, "failures": [], "log_tail": {}})
    assert Job.objects.get(pk=sj.attempt.job_id).status == "SUCCEEDED"
    fake.answers["101"] = HandleStatus(State.RUNNING, nodes=("n1", "n2"))
    slurm.slurm_poll()  # still in Slurm: the agents get STOP_GRACE_S to leave
    sj.refresh_from_db()
    assert sj.cancel_at is not None and sj.released_at is None
    SlurmJob.objects.filter(pk=sj.pk).update(cancel_at=timezone.now() - timedelta(seconds=1))
    with django_capture_on_commit_callbacks(execute=True):
        slurm.slurm_poll()
    assert ("cancel", "101", 0.0) in fake.calls and ("redis_revoke", ("lab-0", "lab-1")) in fake.calls
    assert set(Node.objects.filter(pool=pool).values_list("holder", "credential_digest", "address").distinct()) == {
        (None, "", "")}


def test_a_stop_the_agents_do_not_finish_is_enforced_by_scancel_signal_then_scancel(
        user, pool, fake, sent, django_capture_on_commit_callbacks):
    sj = placed(user, fake, django_capture_on_commit_callbacks)
    agents_up(sj, django_capture_on_commit_callbacks, ranks=True)
    with django_capture_on_commit_callbacks(execute=True):
        services.job_cancel(Job.objects.get(pk=sj.attempt.job_id), user=user)
    assert Attempt.objects.get(pk=sj.attempt_id).status == "STOPPING"
    fake.answers["101"] = HandleStatus(State.RUNNING, nodes=("n1", "n2"))

    def poll() -> list:
        before = len(fake.calls)
        with django_capture_on_commit_callbacks(execute=True):
            slurm.slurm_poll()
        return [c for c in fake.calls[before:] if c[0] == "cancel"]

    assert poll() == []  # the agents are stopping it: Slurm waits STOP_GRACE_S
    SlurmJob.objects.filter(pk=sj.pk).update(cancel_at=timezone.now() - timedelta(seconds=1))
    assert poll() == [("cancel", "101", slurm.STOP_GRACE_S)]  # scancel --signal=TERM to the steps
    assert poll() == []
    SlurmJob.objects.filter(pk=sj.pk).update(cancel_at=timezone.now() - timedelta(seconds=1))
    assert poll() == [("cancel", "101", 0.0)]  # then scancel
    assert Job.objects.get(pk=sj.attempt.job_id).events.filter(kind="slurm_signalled").count() == 1


def test_a_cancel_while_slurm_pends_ends_the_attempt_and_scancels(
        user, pool, fake, sent, django_capture_on_commit_callbacks):
    sj = placed(user, fake, django_capture_on_commit_callbacks)
    job = Job.objects.get(pk=sj.attempt.job_id)
    services.job_cancel(job, user=user)
    fake.answers["101"] = HandleStatus(State.PENDING, reason="Resources", category="resources")
    with django_capture_on_commit_callbacks(execute=True):
        slurm.slurm_poll()
    assert ("cancel", "101", 0.0) in fake.calls
    assert Job.objects.get(pk=job.pk).status == "CANCELLED"


def test_slurms_sigterm_is_a_cooperative_preemption(user, pool, fake, sent, preempts,
                                                     django_capture_on_commit_callbacks):
    sj = placed(user, fake, django_capture_on_commit_callbacks)
    agents_up(sj, django_capture_on_commit_callbacks, ranks=True)
    with django_capture_on_commit_callbacks(execute=True):
        tasks.node_heartbeat(seat_beat("lab-1", "101", "10.0.0.3", draining="SIGTERM from Slurm"))
    attempt = Attempt.objects.get(pk=sj.attempt_id)
    assert attempt.stop_reason == "preempt" and "Slurm took node lab-1 back" in attempt.preempt_reason
    assert preempts and preempts[0][0] == attempt.pk


def test_a_gang_on_a_node_slurm_drains_checkpoints_and_moves(user, pool, fake, sent, preempts,
                                                               django_capture_on_commit_callbacks):
    sj = placed(user, fake, django_capture_on_commit_callbacks)
    agents_up(sj, django_capture_on_commit_callbacks, ranks=True)
    fake.answers["101"] = HandleStatus(State.RUNNING, nodes=("gpu-1", "gpu-2"))
    slurm.slurm_poll()
    assert ("sinfo", ("gpu-1", "gpu-2")) in fake.calls and not preempts  # healthy: nothing moves
    fake.bad["gpu-2"] = ("draining", "disk errors")
    with django_capture_on_commit_callbacks(execute=True):
        slurm.slurm_poll()
        slurm.slurm_poll()
    attempt = Attempt.objects.get(pk=sj.attempt_id)
    assert attempt.stop_reason == "preempt" and attempt.preempt_reason == "Slurm node gpu-2 is draining: disk errors"
    assert len(preempts) == 1 and preempts[0][0] == attempt.pk
    assert attempt.job.events.filter(kind="slurm_node_unhealthy").count() == 1
    calls = len(fake.calls)
    slurm.slurm_poll()  # stopping: its nodes are not asked about again
    assert not [c for c in fake.calls[calls:] if c[0] == "sinfo"]


def test_slurm_is_asked_for_the_gpus_the_job_uses_on_each_node(user, pool, fake, sent,
                                                                django_capture_on_commit_callbacks):
    Pool.objects.filter(pk=pool.pk).update(device="cuda", slots_per_node=8)
    seats_sync(Pool.objects.get(pk=pool.pk))
    placed(user, fake, django_capture_on_commit_callbacks, procs_per_node=2, nodes=2)
    gang = fake.gangs[-1]
    assert (gang.nodes, gang.procs_per_node, gang.gpus_per_node) == (2, 2, 2)


def test_staff_configure_a_pool_and_every_bad_field_is_named(db):
    from django.core.management import CommandError, call_command

    from jobs.core.errors import InvalidInput
    from jobs.fleet.services.pools import pool_save

    with pytest.raises(InvalidInput) as bad:
        pool_save("lab", max_nodes="four", slots_per_node=0, device="tpu", agent_run_dir="relative/dir",
                  agent_env={"TRAINYARD_NODE_CREDENTIAL": "x"},
                  settings={"state_dir": "shared", "partition": "gpu batch", "priority_map": [{"min_priority": 1,
                                                                                               "nice": -5}],
                            "extra_args": ["--uid=0"], "colour": "red"})
    errors = bad.value.errors
    assert {"max_nodes", "slots_per_node", "device", "agent_run_dir", "agent_env"} <= set(errors), errors
    assert {"settings.state_dir", "settings.partition", "settings.priority_map.0.nice", "settings.extra_args.0",
            "settings.colour"} <= set(errors), errors
    assert not Pool.objects.exists() and not Node.objects.exists()  # nothing half-made
    with pytest.raises(CommandError, match="settings.state_dir"):
        call_command("pool_set", "lab", "--json", '{"settings": {"state_dir": "x"}}')
    with pytest.raises(CommandError, match="not JSON"):
        call_command("pool_set", "lab", "--json", "{max_nodes: 2")

    call_command("pool_set", "lab", "--json", '{"max_nodes": 3, "settings": {"state_dir": "/shared/ty", '
                                              '"partition": "gpu", "time_limit_s": 3600}}')
    pool = Pool.objects.get(name="lab")
    assert pool.settings["partition"] == "gpu" and pool.settings["time_limit_s"] == 3600
    assert sorted(Node.objects.filter(pool=pool).values_list("name", flat=True)) == ["lab-0", "lab-1", "lab-2"]
    call_command("pool_set", "lab", "--json", '{"max_nodes": 1, "settings": {"state_dir": "/shared/ty"}}')
    assert list(Node.objects.filter(pool=pool).values_list("name", flat=True)) == ["lab-0"]  # idle seats removed


def test_reconcile_cancels_orphans_but_never_a_job_committed_after_its_first_read(
        user, pool, fake, sent, monkeypatch, django_capture_on_commit_callbacks):
    """With the real backend over a scripted squeue: our live attempt's job adopted, a tagged job no
    attempt owns cancelled, and the job of an attempt committed between reconcile's first read and
    its squeue (a tick's sbatch meanwhile) adopted, not cancelled."""
    from tests.test_slurm_backend import FakeRunner
    from trainyard.slurm import SlurmBackend, SlurmSettings

    first = placed(user, fake, django_capture_on_commit_callbacks)
    tag = backends.attempt_tag(first.attempt.job_id, first.attempt_id)
    orphan = backends.attempt_tag(99999, 99999)
    real = SlurmBackend("lab", SlurmSettings.model_validate({"state_dir": "/shared/ty"}), None)

    class Runner(FakeRunner):
        def run(self, argv, *, timeout, input=None):
            if argv[0] == "squeue" and not self.calls:  # a tick commits the next attempt meanwhile
                job = on_pool(user, nodes=1)
                with django_capture_on_commit_callbacks(execute=True):
                    services.schedule_tick()
                job.refresh_from_db()
                assert SlurmJob.objects.filter(attempt__job=job).exists(), (job.status, job.status_reason)
                self.late = SlurmJob.objects.get(attempt__job=job)
                late = backends.attempt_tag(self.late.attempt.job_id, self.late.attempt_id)
                self.answers["squeue"] = [(0, f"101|{tag}|RUNNING|trainyard:lab\n55|{orphan}|RUNNING|trainyard:lab\n"
                                              f"102|{late}|PENDING|trainyard:lab\n", "")]
            return super().run(argv, timeout=timeout, input=input)

    real.runner = Runner()
    monkeypatch.setattr(slurm, "backend_for", lambda pool: real)
    assert slurm.slurm_reconcile() == 1
    assert [c for c in real.runner.calls if c[0] == "scancel"] == [["scancel", "55"]]
