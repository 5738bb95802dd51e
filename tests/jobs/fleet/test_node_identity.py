"""Node identity and authenticated reports (issue 16, section 1): staff register nodes, unknown
nodes become join requests, reports are signed and count only from the node that owns them.

Before: `node_heartbeat` upserted any node from any heartbeat, a heartbeat rewrote the node's
address and slots (a forged `slots: 4096` put 64 processes on a 2-slot node), and an exit report
for any attempt was applied whoever sent it."""
from __future__ import annotations

import os
import time

import pytest
from django.core.management import CommandError, call_command

from jobs.telemetry import prometheus
from jobs import services, tasks
from jobs.models import Allocation, Attempt, Node, NodeJoinRequest, SecurityEvent
from tests.nodes import credential, node_up, signed
from trainyard import nodeauth
from trainyard.launch import HEARTBEAT_TASK, NODE_EXIT_TASK, RANKS_TASK, Heartbeat

from tests.jobs.runs.test_services import ok_result, start, submit

pytestmark = pytest.mark.django_db


def beat(name: str, address: str = "127.0.0.1", slots: int = 2, **kw) -> dict:
    return {"name": name, "address": address, "slots": slots, "labels": {}, "cpu_percent": 1.0, "mem_percent": 2.0,
            **kw}


def metric(name: str, **labels) -> float:
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    for line in prometheus.render().splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{want} not in /metrics")


def test_a_heartbeat_from_an_unknown_node_is_refused_and_becomes_a_join_request(sent):
    forged = {"node": "rogue", "task": HEARTBEAT_TASK, "ts": time.time(), "body": beat("rogue", "10.6.6.6", 4096),
              "sig": ""}
    tasks.node_heartbeat(forged)
    tasks.node_heartbeat(forged)
    assert not Node.objects.filter(name="rogue").exists()
    req = NodeJoinRequest.objects.get(name="rogue")
    assert (req.address, req.slots, req.heartbeats) == ("10.6.6.6", 4096, 2)
    assert metric("trainyard_node_join_requests") == 1
    # The service refuses it too (a caller that skipped report_open cannot add a node).
    assert services.node_heartbeat(Heartbeat.model_validate(beat("rogue2")))[0] is None and not Node.objects.filter(name="rogue2").exists()


def test_approving_a_join_request_registers_the_node_with_a_credential_once(sent, admin_client):
    tasks.node_heartbeat(nodeauth.seal(None, "gpu-7", HEARTBEAT_TASK, beat("gpu-7", "10.0.0.7", 8), time.time()))
    req = NodeJoinRequest.objects.get(name="gpu-7")
    resp = admin_client.post("/admin/jobs/nodejoinrequest/", {"action": "approve", "_selected_action": [req.pk]},
                       follow=True)
    assert resp.status_code == 200
    node = Node.objects.get(name="gpu-7")
    assert (node.address, node.slots_approved, node.status) == ("10.0.0.7", 8, "LOST")  # LOST until it beats
    shown = [str(m) for m in resp.context["messages"]]
    cred = credential("gpu-7")
    assert any(cred in m for m in shown) and cred not in (node.credential_digest, node.credential_salt)
    assert not NodeJoinRequest.objects.exists()
    tasks.node_heartbeat(signed(HEARTBEAT_TASK, beat("gpu-7", "10.0.0.7", 8), node="gpu-7"))
    assert Node.objects.get(name="gpu-7").status == "READY"


def test_a_heartbeat_cannot_move_the_address_or_grow_the_slots(nodes, sent):
    services.node_heartbeat(Heartbeat.model_validate(beat("node-a", "10.6.6.6", 4096)))  # signed or not, the service keeps staff's values
    tasks.node_heartbeat(signed(HEARTBEAT_TASK, beat("node-a", "10.6.6.6", 4096)))
    node = Node.objects.get(name="node-a")
    assert (node.address, node.slots) == ("127.0.0.1", 2)
    assert metric("trainyard_security_events_total", kind="address_mismatch") == 2
    assert metric("trainyard_security_events_total", kind="slots_over_approved") == 2
    tasks.node_heartbeat(signed(HEARTBEAT_TASK, beat("node-a", "127.0.0.1", 1)))  # fewer: fine
    assert Node.objects.get(name="node-a").slots == 1


def test_forged_signatures_stale_and_misnamed_heartbeats_are_refused(nodes, sent):
    before = Node.objects.get(name="node-a").last_heartbeat
    wrong_key = nodeauth.seal("not-the-credential", "node-a", HEARTBEAT_TASK, beat("node-a"), time.time())
    tasks.node_heartbeat(wrong_key)
    tasks.node_heartbeat(signed(HEARTBEAT_TASK, beat("node-a"), ts=time.time() - 3600))  # a replayed one
    tasks.node_heartbeat(signed(HEARTBEAT_TASK, beat("node-a"), node="node-b"))  # node-b speaking for node-a
    tasks.node_heartbeat(signed(RANKS_TASK, beat("node-a")))  # signed for another task
    assert Node.objects.get(name="node-a").last_heartbeat == before
    kinds = dict(SecurityEvent.objects.values_list("kind", "count"))
    assert kinds == {"bad_signature": 1, "stale": 1, "name_mismatch": 1, "wrong_task": 1}


def test_a_report_for_another_nodes_attempt_is_refused_and_counted(user, nodes, sent):
    job = submit(user, resources={"nodes": 1, "procs_per_node": 1}, parallel={"dp": 1})
    attempt = start(job)
    owner = attempt.allocations.get().node.name
    intruder = ({"node-a", "node-b"} - {owner}).pop()
    credential(intruder)
    tasks.attempt_node_exit(signed(NODE_EXIT_TASK, {"attempt_id": attempt.pk, "result": {
        "attempt_id": attempt.pk, "node": intruder, "exit_code": 1, "failures": []}}, node=intruder))
    tasks.attempt_ranks(signed(RANKS_TASK, {"attempt_id": attempt.pk, "ranks": [
        {"rank": 0, "local_rank": 0, "pid": 6666}]}, node=intruder))
    # ... and an exit report naming the owner, signed by the intruder.
    tasks.attempt_node_exit(signed(NODE_EXIT_TASK, {"attempt_id": attempt.pk, "result": ok_result(owner, attempt.pk)},
                                   node=intruder))
    attempt.refresh_from_db()
    alloc = attempt.allocations.get()
    assert attempt.status == Attempt.Status.RUNNING and alloc.active and alloc.ranks[0]["pid"] != 6666
    assert SecurityEvent.objects.get(kind="foreign_allocation", node=intruder).count == 3
    assert metric("trainyard_security_events_total", kind="foreign_allocation") == 3


def test_a_correctly_signed_report_from_the_owner_is_applied(user, nodes, sent):
    job = submit(user, resources={"nodes": 1, "procs_per_node": 1}, parallel={"dp": 1})
    services.schedule_tick()
    attempt = job.attempts.get()
    owner = attempt.allocations.get().node.name
    tasks.attempt_ranks(signed(RANKS_TASK, {"attempt_id": attempt.pk, "ranks": [
        {"rank": 0, "local_rank": 0, "pid": 4242}]}, node=owner))
    attempt.refresh_from_db()
    assert attempt.status == Attempt.Status.RUNNING
    tasks.attempt_node_exit(signed(NODE_EXIT_TASK, {"attempt_id": attempt.pk, "result": ok_result(owner, attempt.pk)},
                                   node=owner))
    assert not Allocation.objects.get(attempt=attempt).active
    attempt.refresh_from_db()
    assert attempt.status == Attempt.Status.ENDED and not SecurityEvent.objects.exists()


def test_node_add_shows_the_credential_once_and_stores_only_its_digest(tmp_path, capsys, db):
    call_command("node_add", "node-x", "--slots", "4", "--address", "10.1.2.3", "--labels", "rack=r2", "gpu=a100")
    cred = capsys.readouterr().out.strip()
    node = Node.objects.get(name="node-x")
    assert (node.slots_approved, node.address, node.labels) == (4, "10.1.2.3", {"rack": "r2", "gpu": "a100"})
    assert node.credential_digest == nodeauth.fingerprint(cred) and cred not in str(Node.objects.values().get())
    with pytest.raises(CommandError, match="already registered"):
        call_command("node_add", "node-x")
    out = tmp_path / "creds" / "node-x"
    call_command("node_add", "node-x", "--slots", "4", "--reissue", "--credential-out", str(out))
    assert oct(out.stat().st_mode & 0o777) == "0o600" and out.read_text().strip() != cred
    with pytest.raises(CommandError, match="name"):
        call_command("node_add", "../etc")


def test_the_agent_refuses_a_credential_file_others_can_read(tmp_path):
    from workers import agent

    path = tmp_path / "cred"
    path.write_text("s3cret\n")
    os.chmod(path, 0o644)
    with pytest.raises(SystemExit, match="mode 0644"):
        agent.load_credential(str(path), "node-a")
    os.chmod(path, 0o600)
    assert agent.load_credential(str(path), "node-a") == "s3cret"
    with pytest.raises(SystemExit, match="cannot open"):
        agent.load_credential(str(tmp_path / "missing"), "node-a")


def test_node_up_helper_registers_like_staff(db, sent):
    node, _ = node_up(beat("node-z", "127.0.0.5"))
    assert node.status == "READY" and node.credential_digest


def test_what_the_agent_sends_is_what_the_control_plane_opens(nodes, sent, tmp_path, monkeypatch):
    from workers import agent

    out = []
    monkeypatch.setattr(agent.app, "send_task", lambda task, args, **kw: out.append((task, args)))
    a = agent.Agent("node-a", "127.0.0.1", 2, {}, "cpu", tmp_path / "node-a", credential=credential("node-a"))
    a.report(HEARTBEAT_TASK, a.heartbeat_payload().model_dump(mode="json"), expires=10)
    (task, (envelope,)), = out
    node, body = services.report_open(envelope, task=task)
    assert node.name == "node-a" and body["name"] == "node-a" and not SecurityEvent.objects.exists()


def test_the_nodes_page_shows_join_requests_to_staff_only(sent, staff, user, client):
    tasks.node_heartbeat(nodeauth.seal(None, "gpu-9", HEARTBEAT_TASK, beat("gpu-9", "10.0.0.9", 8), time.time()))
    client.force_login(user)
    assert b"gpu-9" not in client.get("/nodes/").content
    client.force_login(staff)
    page = client.get("/nodes/").content.decode()
    assert 'id="join-requests"' in page and "gpu-9" in page and "10.0.0.9" in page


def test_commands_down_a_nodes_queue_are_sealed_with_its_credential(nodes, monkeypatch):
    """The control plane signs Launch, Stop and calibration requests with the node's credential,
    derived from its master key and the node's salt (the database keeps no credential)."""
    from jobs.core import dispatch
    from trainyard.launch import NODE_LAUNCH_TASK, NODE_STOP_TASK

    monkeypatch.undo()  # the real send_stop, with Celery's send_task recorded instead of sent
    out = []
    monkeypatch.setattr(dispatch.app, "send_task", lambda task, args, queue, **kw: out.append((task, args, queue)))
    dispatch.send_stop("node-a", 3, 7, "cancel")
    task, (envelope,), queue = out[0]
    assert (task, queue, envelope["node"], envelope["task"]) == (NODE_STOP_TASK, "node.node-a", "node-a", NODE_STOP_TASK)
    assert envelope["body"] == {"job_id": 3, "attempt_id": 7, "reason": "cancel"}
    assert nodeauth.signature_ok(credential("node-a"), envelope)
    assert not nodeauth.signature_ok(credential("node-b"), envelope)
    launch = dispatch.sealed("node-b", NODE_LAUNCH_TASK, {"attempt_id": 1})
    assert nodeauth.signature_ok(credential("node-b"), launch) and abs(launch["ts"] - time.time()) < 5
    assert dispatch.sealed("never-registered", NODE_LAUNCH_TASK, {})["sig"] == ""


def test_the_task_is_the_edge_a_heartbeat_is_validated_there_and_the_service_takes_only_the_typed_value(nodes, sent):
    """Issue 22 s4: the task parses the bus message once; a signed heartbeat whose body is no
    Heartbeat is refused and counted there, and the service refuses an unparsed dict."""
    before = Node.objects.get(name="node-a").last_heartbeat
    tasks.node_heartbeat(signed(HEARTBEAT_TASK, beat("node-a", slots="many")))
    assert Node.objects.get(name="node-a").last_heartbeat == before
    assert dict(SecurityEvent.objects.values_list("kind", "count")) == {"malformed": 1}
    with pytest.raises(TypeError, match="Heartbeat"):
        services.node_heartbeat(beat("node-a"))
