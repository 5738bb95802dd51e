"""Issue 15, section 3: API tokens hashed at rest, revocation closing websockets, exact websocket
origins. Websockets go through the real ASGI application (controlplane.asgi) with
WebsocketCommunicator and the in-memory channel layer, as tests/jobs/runs/test_consumers.py."""
import hashlib

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.core.management import call_command
from django.db import connection
from django.test import Client
from rest_framework.test import APIClient

from jobs.core import dispatch
from jobs.access import services as access_services
from jobs.access import tokens
from jobs.models import ApiToken

REAL_PUBLISH = dispatch.publish  # tests/jobs/conftest.py records publishes instead; these need them sent

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def memory_layer(settings, monkeypatch):
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    monkeypatch.setattr(dispatch, "publish", REAL_PUBLISH)


@pytest.fixture
def app():
    from controlplane.asgi import application

    return application


def api_status(key: str) -> int:
    c = APIClient()
    c.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    return c.get("/api/v1/jobs/").status_code


# ---------------------------------------------------------------- tokens at rest

def test_api_token_prints_a_new_key_stored_only_as_its_sha256(user, capsys):
    call_command("api_token", "alice")
    key = capsys.readouterr().out.strip()
    token = ApiToken.objects.get(user=user)
    assert token.digest == hashlib.sha256(key.encode()).hexdigest() and token.prefix == key[:8]
    with connection.cursor() as cursor:  # the key itself is nowhere in the table
        cursor.execute("SELECT * FROM jobs_apitoken")
        assert not [v for row in cursor.fetchall() for v in row if isinstance(v, str) and key in v]
    assert api_status(key) == 200
    assert api_status(token.digest) == 401  # a stolen digest is no key
    assert api_status(key[:-1] + ("A" if key[-1] != "A" else "B")) == 401
    assert api_status("x" * 5000) == 401
    call_command("api_token", "alice")
    second = capsys.readouterr().out.strip()
    assert second != key and api_status(key) == 200 and api_status(second) == 200  # a new one each time
    call_command("api_token", "alice", "--revoke")
    assert api_status(key) == 401 and api_status(second) == 401 and not ApiToken.objects.exists()


def test_a_token_of_an_inactive_user_does_not_authenticate(user):
    key = access_services.token_issue(user)
    user.is_active = False
    user.save()
    assert api_status(key) == 401


def test_plaintext_tokens_from_drf_authtoken_are_migrated_to_their_hash(user, other):
    """An older database has rest_framework.authtoken's table with keys in clear text: migration
    0010 moves each into ApiToken as its SHA-256 (the same key keeps working) and wipes the table."""
    import importlib

    from django.apps import apps

    migration = importlib.import_module("jobs.migrations.0010_secrets_api_tokens")
    alice_key, bob_key = "9944b09199c62bcf9418ad846dd0e4bbdfc6ee4b", "0123456789abcdef0123456789abcdef01234567"
    with connection.cursor() as cursor:
        cursor.execute('CREATE TABLE "authtoken_token" ("key" varchar(40) NOT NULL PRIMARY KEY, '
                       f'"created" {connection.data_types["DateTimeField"]} NOT NULL, '  # per database
                       '"user_id" integer NOT NULL UNIQUE)')
        cursor.execute('INSERT INTO "authtoken_token" VALUES (%s, %s, %s), (%s, %s, %s), (%s, %s, %s)',
                       [alice_key, "2026-01-02 03:04:05", user.pk, bob_key, "2026-01-02 03:04:05", other.pk,
                        "f" * 40, "2026-01-02 03:04:05", 999999])  # a row whose user is gone is dropped
    try:
        with connection.schema_editor() as editor:
            migration.hash_plaintext_tokens(apps, editor)
        with connection.cursor() as cursor:
            cursor.execute('SELECT COUNT(*) FROM "authtoken_token"')
            assert cursor.fetchone() == (0,)
    finally:
        with connection.cursor() as cursor:
            cursor.execute('DROP TABLE "authtoken_token"')
    assert sorted(ApiToken.objects.values_list("user__username", "digest")) == [
        ("alice", hashlib.sha256(alice_key.encode()).hexdigest()), ("bob", hashlib.sha256(bob_key.encode()).hexdigest())]
    assert ApiToken.objects.get(user=user).created.year == 2026
    assert api_status(alice_key) == 200 and api_status(bob_key) == 200


# ---------------------------------------------------------------- revocation closes websockets

def session_headers(user, origin=b"http://testserver", host=b"testserver"):
    c = Client()
    c.force_login(user)
    headers = [(b"host", host), (b"cookie", f"sessionid={c.cookies['sessionid'].value}".encode())]
    return headers + ([(b"origin", origin)] if origin is not None else [])


async def open_socket(app, headers, path="/ws/cluster/"):
    comm = WebsocketCommunicator(app, path, headers=headers)
    connected, _ = await comm.connect(timeout=5)
    assert connected
    assert (await comm.receive_json_from(timeout=5))["type"] == "snapshot"
    return comm


async def assert_closed(comm, code=tokens.REVOKED_CLOSE_CODE):
    msg = await comm.receive_output(timeout=5)
    assert msg["type"] == "websocket.close" and msg["code"] == code, msg


def token_headers(key):
    return [(b"authorization", f"Token {key}".encode())]


def test_revoking_a_token_closes_the_sockets_it_opened_and_no_other(app, user, other):
    first, second, bobs = access_services.token_issue(user), access_services.token_issue(user), access_services.token_issue(other)
    browser = session_headers(user)

    async def go():
        by_first = await open_socket(app, token_headers(first))
        by_first_job = WebsocketCommunicator(app, "/ws/jobs/1/", headers=token_headers(first))
        await by_first_job.connect(timeout=5)
        assert (await by_first_job.receive_output(timeout=5))["code"] == 4404  # no such job: not joined
        others = [await open_socket(app, token_headers(second)), await open_socket(app, token_headers(bobs)),
                  await open_socket(app, browser)]
        await database_sync_to_async(ApiToken.objects.filter(digest=tokens.digest(first)).delete)()
        await assert_closed(by_first)
        for comm in others:
            assert await comm.receive_nothing(timeout=0.3)
            await comm.send_json_to({"type": "ping"})
            assert (await comm.receive_json_from(timeout=5)) == {"type": "pong"}
        # `api_token --revoke` deletes the rest of alice's tokens: their sockets close too
        await database_sync_to_async(call_command)("api_token", "alice", "--revoke")
        await assert_closed(others[0])
        assert await others[1].receive_nothing(timeout=0.3) and await others[2].receive_nothing(timeout=0.1)
        for comm in others[1:]:
            await comm.disconnect()
    async_to_sync(go)()
    assert api_status(first) == 401 and api_status(second) == 401 and api_status(bobs) == 200


def test_deactivating_a_user_closes_all_their_sockets(app, user, other):
    alice, bob = access_services.token_issue(user), access_services.token_issue(other)
    browser = session_headers(user)

    async def go():
        mine = [await open_socket(app, token_headers(alice)), await open_socket(app, browser)]
        bobs = await open_socket(app, token_headers(bob))

        def deactivate():
            user.is_active = False
            user.save()
        await database_sync_to_async(deactivate)()
        for comm in mine:
            await assert_closed(comm)
        assert await bobs.receive_nothing(timeout=0.3)
        await bobs.disconnect()
        # and neither the token nor the session opens a new one
        for headers in (token_headers(alice), browser):
            comm = WebsocketCommunicator(app, "/ws/cluster/", headers=headers)
            await comm.connect(timeout=5)
            assert (await comm.receive_output(timeout=5))["code"] == 4401
    async_to_sync(go)()


def test_a_socket_revoked_between_handshake_and_join_is_closed(user):
    """The consumer re-checks after joining its groups: a revocation in between cannot be missed."""
    key = access_services.token_issue(user)
    token_id = tokens.lookup(key).pk
    assert tokens.still_valid(user.pk, token_id) and tokens.still_valid(user.pk, None)
    ApiToken.objects.filter(pk=token_id).delete()
    assert not tokens.still_valid(user.pk, token_id) and tokens.still_valid(user.pk, None)
    user.is_active = False
    user.save()
    assert not tokens.still_valid(user.pk, None)


# ---------------------------------------------------------------- exact origins

def origin_opens(app, user, origin: bytes, host=b"testserver", extra=()) -> bool:
    headers = session_headers(user, origin, host) + list(extra)

    async def go():
        comm = WebsocketCommunicator(app, "/ws/cluster/", headers=headers)
        connected, _ = await comm.connect(timeout=5)
        if connected:
            await comm.disconnect()
        return connected
    return async_to_sync(go)()


def test_origin_must_match_scheme_host_and_port_of_the_served_origin(app, user):
    """Before, any Origin whose host name was in ALLOWED_HOSTS passed: https://testserver and
    http://testserver:8000 opened the http://testserver dashboard's sockets."""
    assert origin_opens(app, user, b"http://testserver")
    assert origin_opens(app, user, b"http://TestServer:80/")
    assert not origin_opens(app, user, b"https://testserver")  # wrong scheme
    assert not origin_opens(app, user, b"http://testserver:8000")  # wrong port
    assert not origin_opens(app, user, b"http://evil.example")
    assert not origin_opens(app, user, b"null")
    assert origin_opens(app, user, b"http://testserver:8000", host=b"testserver:8000")
    assert not origin_opens(app, user, b"http://testserver", host=b"testserver:8000")
    # a Host that is not one of ALLOWED_HOSTS (DNS rebinding) is no origin of ours either
    assert not origin_opens(app, user, b"http://rebind.example", host=b"rebind.example")


def test_configured_origins_are_compared_exactly(app, user, settings):
    settings.TRAINYARD_WS_ORIGINS = ["https://ty.example"]
    assert origin_opens(app, user, b"https://ty.example")
    assert origin_opens(app, user, b"https://ty.example:443")
    assert not origin_opens(app, user, b"http://ty.example")
    assert not origin_opens(app, user, b"https://ty.example:8443")
    assert not origin_opens(app, user, b"http://testserver")  # the list replaces the served origin


def test_behind_a_tls_proxy_the_served_origin_is_https(app, user, settings):
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    proto = [(b"x-forwarded-proto", b"https")]
    assert origin_opens(app, user, b"https://testserver", extra=proto)
    assert not origin_opens(app, user, b"http://testserver", extra=proto)
    assert origin_opens(app, user, b"http://testserver")
