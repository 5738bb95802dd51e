"""Websocket consumers through the real ASGI stack (auth middleware, routing) with
WebsocketCommunicator; the channel layer is in-memory here (no processes), the integration
tests use channels_redis with daphne as a real process."""
import json

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from django.test import Client

from jobs.runs import consumers
from jobs.access import services as access_services
from jobs import services

pytestmark = pytest.mark.django_db(transaction=True)  # database_sync_to_async closes connections


@pytest.fixture(autouse=True)
def memory_layer(settings):
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}


@pytest.fixture
def app():
    from controlplane.asgi import application

    return application


def session_headers(user, origin=b"http://testserver"):
    c = Client()
    c.force_login(user)
    headers = [(b"host", b"testserver"), (b"cookie", f"sessionid={c.cookies['sessionid'].value}".encode())]
    if origin is not None:
        headers.append((b"origin", origin))
    return headers


def sample(attempt, rank, step):
    return {"rank": rank, "step": step, "ts": 1764471234.0 + step, "loss": 3.0, "samples_per_s": 1.0,
            "tokens_per_s": 2.0, "step_s": 0.1, "data_s": 0.0, "compute_s": 0.05, "comm_s": 0.01,
            "optim_s": 0.01, "bytes_sent": 4, "mem_bytes": 8, "attempt": attempt}


def run(coro_fn):
    return async_to_sync(coro_fn)()


async def connect(app, path, headers):
    comm = WebsocketCommunicator(app, path, headers=headers)
    connected, _ = await comm.connect()
    return comm, connected


@pytest.fixture
def job(user, nodes):
    job = services.job_submit(user=user, spec=services.submitted_spec({"name": "live"}))
    services.schedule_tick()
    attempt = job.attempts.get()
    services.telemetry_ingest([sample(attempt.pk, r, s) for s in range(1, 6) for r in (0, 1)], events=[])
    return job


@pytest.mark.parametrize("who,expect", [("anonymous", 4401), ("other", 4404), ("owner", None), ("staff", None)])
def test_job_socket_auth(app, job, user, other, staff, who, expect):
    headers = {"anonymous": [(b"host", b"testserver"), (b"origin", b"http://testserver")],
               "other": session_headers(other), "owner": session_headers(user), "staff": session_headers(staff)}[who]

    async def go():
        comm, connected = await connect(app, f"/ws/jobs/{job.pk}/", headers)
        msg = await comm.receive_output(timeout=5)
        if expect is None:
            body = json.loads(msg["text"])
            assert body["type"] == "snapshot" and body["seq"] == 1 and body["job"]["id"] == job.pk
            assert len(body["samples"]) == 10 and {s["rank"] for s in body["samples"]} == {0, 1}
            assert set(body["samples"][0]) >= {"rank", "step", "ts", "loss", "attempt", "comm_s"}
            assert [e["kind"] for e in body["events"]][:2] == ["submitted", "attempt_started"]
        else:
            assert msg["type"] == "websocket.close" and msg["code"] == expect
        await comm.disconnect()
    run(go)


def test_foreign_origin_is_refused_and_token_clients_need_no_origin(app, job, user):
    key = access_services.token_issue(user)
    evil, no_origin = session_headers(user, b"http://evil.example"), session_headers(user, origin=None)

    async def go():
        comm, connected = await connect(app, f"/ws/jobs/{job.pk}/", evil)
        assert not connected
        # no Origin: the session cookie alone does not count, a token does
        comm, _ = await connect(app, f"/ws/jobs/{job.pk}/", no_origin)
        assert (await comm.receive_output(timeout=5))["code"] == 4401
        comm, connected = await connect(app, f"/ws/jobs/{job.pk}/", [(b"authorization", f"Token {key}".encode())])
        assert connected and (await comm.receive_json_from(timeout=5))["type"] == "snapshot"
        await comm.disconnect()
        comm, _ = await connect(app, f"/ws/jobs/{job.pk}/", [(b"authorization", b"Token nope")])
        assert (await comm.receive_output(timeout=5))["code"] == 4401
    run(go)


def test_malformed_messages_get_error_frames_not_a_crash(app, job, user):
    headers = session_headers(user)

    async def go():
        comm, _ = await connect(app, f"/ws/jobs/{job.pk}/", headers)
        await comm.receive_json_from(timeout=5)
        for bad in ("not json", "[1, 2]", '{"type": 5}', '{"type": "launch-missiles"}', '{"type": "ack", "seq": 99}',
                    '{"type": "ack", "seq": "x"}'):
            await comm.send_to(text_data=bad)
            reply = await comm.receive_json_from(timeout=5)
            assert reply["type"] == "error" and reply["error"], bad
        await comm.send_to(bytes_data=b"\x00\x01")
        assert (await comm.receive_json_from(timeout=5))["type"] == "error"
        await comm.send_json_to({"type": "ping"})
        assert (await comm.receive_json_from(timeout=5)) == {"type": "pong"}
        await comm.disconnect()
    run(go)


def test_live_telemetry_status_and_flow_control_window(app, job, user):
    attempt = job.attempts.get()
    layer = get_channel_layer()

    headers = session_headers(user)

    async def go():
        comm, _ = await connect(app, f"/ws/jobs/{job.pk}/", headers)
        snap = await comm.receive_json_from(timeout=5)
        await comm.send_json_to({"type": "ack", "seq": snap["seq"]})
        await layer.group_send(f"job.{job.pk}", {"type": "job.telemetry", "samples": [sample(attempt.pk, 0, 6)]})
        live = await comm.receive_json_from(timeout=5)
        assert live["type"] == "telemetry" and live["samples"][0]["step"] == 6 and live["seq"] == 2
        await layer.group_send(f"job.{job.pk}", {"type": "job.status", "status": "RUNNING", "attempt": attempt.pk,
                                                 "status_reason": "", "step": 6})
        assert (await comm.receive_json_from(timeout=5))["type"] == "status"
        # The client stops acking: after MAX_INFLIGHT unacked messages nothing more is sent.
        sent = 3
        for step in range(7, 7 + consumers.MAX_INFLIGHT + 20):
            await layer.group_send(f"job.{job.pk}", {"type": "job.telemetry", "samples": [sample(attempt.pk, 0, step)]})
        received = []
        while not await comm.receive_nothing(timeout=0.3):
            received.append(await comm.receive_json_from())
        assert len(received) == consumers.MAX_INFLIGHT - sent + 1
        last_seq = received[-1]["seq"]
        # Catching up yields one downsampled window from the database, not the backlog.
        await comm.send_json_to({"type": "ack", "seq": last_seq})
        window = await comm.receive_json_from(timeout=5)
        assert window["type"] == "window" and window["downsampled"] is True
        assert window["from_step"] == received[-1]["samples"][0]["step"] + 1
        assert all(s["step"] >= window["from_step"] for s in window["samples"])
        await comm.disconnect()
    run(go)


def test_cluster_socket_snapshot_and_changes(app, job, user):
    headers = session_headers(user)

    async def go():
        comm, _ = await connect(app, "/ws/cluster/", headers)
        snap = await comm.receive_json_from(timeout=5)
        assert snap["type"] == "snapshot" and [n["name"] for n in snap["nodes"]] == ["node-a", "node-b"]
        assert [j["id"] for j in snap["running"]] == [job.pk] and snap["queue"] == []
        await get_channel_layer().group_send("cluster", {"type": "cluster.changed", "what": "nodes"})
        kinds = {(await comm.receive_json_from(timeout=5))["type"], (await comm.receive_json_from(timeout=5))["type"]}
        assert kinds == {"nodes", "jobs"}
        await comm.disconnect()
        comm, _ = await connect(app, "/ws/cluster/", [(b"host", b"testserver"), (b"origin", b"http://testserver")])
        assert (await comm.receive_output(timeout=5))["code"] == 4401
    run(go)


def test_large_snapshot_goes_out_in_frames_under_daphnes_1mib_limit(app, job, user):
    attempt = job.attempts.get()
    services.telemetry_ingest([sample(attempt.pk, r, s) for s in range(6, 1801) for r in (0, 1)], events=[])
    headers = session_headers(user)

    async def go():
        comm, _ = await connect(app, f"/ws/jobs/{job.pk}/", headers)
        frames = [await comm.receive_output(timeout=5)]
        while not await comm.receive_nothing(timeout=0.3):
            frames.append(await comm.receive_output())
        bodies = [json.loads(f["text"]) for f in frames]
        assert bodies[0]["type"] == "snapshot" and all(b["type"] == "telemetry" for b in bodies[1:])
        assert all(len(f["text"].encode()) < 1 << 20 for f in frames)
        keys = {(s["rank"], s["step"]) for b in bodies for s in b["samples"]}
        assert len(keys) == sum(len(b["samples"]) for b in bodies) == 1000  # every rank's last 500 steps
        # the reduced steps: 1,795 steps bucketed to at most 1,500 points, 500 rows a frame
        steps = [r["step"] for b in bodies for r in b["steps"]]
        assert len(bodies) >= 3 and len(bodies[0]["steps"]) == consumers.CHUNK_STEPS
        assert steps == sorted(set(steps)) and len(steps) <= 1500 and steps[-1] == 1800
        assert bodies[0]["bucketed"] is True and bodies[0]["named"]["all"] is True
        await comm.disconnect()
    run(go)


def test_the_relays_reduced_message_is_spliced_into_the_frame_and_flow_controlled(app, job, user):
    from jobs.telemetry.publish import reduced_message

    layer = get_channel_layer()
    headers = session_headers(user)
    named = {"slowest": [{"rank": 17, "count": 3}], "fastest": [], "all": False, "window": 3}

    def row(step):
        return {"attempt": 1, "step": step, "ts": 1.0, "ranks": 64, "step_s": [0.1, 0.2, 0.9, 64]}

    async def go():
        comm, _ = await connect(app, f"/ws/jobs/{job.pk}/", headers)
        snap = await comm.receive_json_from(timeout=5)
        await layer.group_send(f"job.{job.pk}", reduced_message([row(6), row(7)], [sample(1, 17, 6)], named))
        live = await comm.receive_json_from(timeout=5)
        assert live == {"type": "telemetry", "seq": snap["seq"] + 1, "steps": [row(6), row(7)],
                        "samples": [sample(1, 17, 6)], "named": named}
        await layer.group_send(f"job.{job.pk}", reduced_message([], [], named))  # nothing in it: not sent
        for step in range(8, 8 + consumers.MAX_INFLIGHT + 5):
            await layer.group_send(f"job.{job.pk}", reduced_message([row(step)], [], named))
        received = []
        while not await comm.receive_nothing(timeout=0.3):
            received.append(await comm.receive_json_from())
        assert len(received) == consumers.MAX_INFLIGHT - 2  # the snapshot and the first are unacked
        assert received[0]["steps"][0]["step"] == 8
        await comm.send_json_to({"type": "ack", "seq": received[-1]["seq"]})
        window = await comm.receive_json_from(timeout=5)
        assert window["type"] == "window" and window["from_step"] == received[-1]["steps"][0]["step"] + 1
        assert set(window) >= {"steps", "samples", "named", "bucketed", "logs"}
        await comm.disconnect()
    run(go)
