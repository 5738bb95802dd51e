"""Bundle uploads through the real web server (daphne + Django's ASGI handler): an upload near the
limit is stored byte for byte, once; one over the limit is refused from its Content-Length by
the ASGI guard (daphne hands a request to the application only once its whole body has arrived,
so the body is sent, but Django never parses or spools it); a chunked one is 411; a malicious
one stores nothing."""
from __future__ import annotations

import gzip
import hashlib
import http.client
import io
import json
import os
import subprocess
import tarfile
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests import postgres
from tests.conftest import REPO
from tests.integration.cluster import PY, start_daphne
from trainyard import keys

pytestmark = pytest.mark.procs

LIMIT = 4 * 1024 * 1024


@pytest.fixture(scope="module")
def web(tmp_path_factory):
    work = tmp_path_factory.mktemp("bundle-web")
    env = dict(os.environ, PYTHONPATH=str(REPO), DJANGO_SETTINGS_MODULE="controlplane.settings",
               TRAINYARD_VAR_DIR=str(work / "var"), **postgres.fresh_database_env(work / "db.sqlite3"),
               TRAINYARD_ARTIFACT_ROOT=str(work / "artifacts"), DJANGO_SECRET_KEY="integration-tests-only",
               TRAINYARD_BUNDLE_MAX_BYTES=str(LIMIT), TRAINYARD_ADMIN_PASSWORD="integration-pw-1")
    for args in (["migrate", "--noinput", "-v", "0"], ["ensure_admin"]):
        subprocess.run([PY, "manage.py", *args], cwd=REPO, env=env, check=True, capture_output=True)
    token = subprocess.run([PY, "manage.py", "api_token", "admin"], cwd=REPO, env=env, check=True,
                           capture_output=True, text=True).stdout.strip()
    proc, port = start_daphne(env, work)
    yield {"port": port, "token": token, "root": work / "artifacts", "proc": proc}
    proc.terminate()
    proc.wait(20)


def multipart(path: Path, boundary: str = "trainyard-test-boundary") -> tuple[bytes, bytes, int]:
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"code.tar.gz\"\r\n"
            "Content-Type: application/gzip\r\n\r\n").encode()
    tail = f"\r\n--{boundary}--\r\n".encode()
    return head, tail, len(head) + path.stat().st_size + len(tail)


def post_file(web, path: Path) -> tuple[int, dict]:
    head, tail, length = multipart(path)
    conn = http.client.HTTPConnection("127.0.0.1", web["port"], timeout=120)
    conn.putrequest("POST", "/api/v1/code/")
    conn.putheader("Authorization", f"Token {web['token']}")
    conn.putheader("Content-Type", "multipart/form-data; boundary=trainyard-test-boundary")
    conn.putheader("Content-Length", str(length))
    conn.endheaders()
    conn.send(head)
    with open(path, "rb") as f:
        while chunk := f.read(1024 * 1024):
            conn.send(chunk)
    conn.send(tail)
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read())


def big_bundle(directory: Path, size: int) -> Path:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in (("train.py", b"print('big')\n"), ("weights.bin", os.urandom(size))):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path = directory / "big.tar.gz"
    path.write_bytes(gzip.compress(buf.getvalue(), compresslevel=1))
    return path


def test_upload_near_the_limit_is_stored_once(web, tmp_path):
    path = big_bundle(tmp_path, LIMIT - 64 * 1024)
    started = time.monotonic()
    status, body = post_file(web, path)
    took = time.monotonic() - started
    digest = "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    assert status == 201, body
    assert body == {"bundle": digest, "bytes": path.stat().st_size, "files": 2}
    print(f"\n{path.stat().st_size} bytes uploaded and stored in {took:.2f} s")
    stored = keys.bundle_path(web["root"], digest)
    assert stored.read_bytes() == path.read_bytes()
    status, again = post_file(web, path)
    assert status == 200 and again == body
    assert sorted((web["root"] / "bundles").rglob("*.tar.gz")) == [stored]
    assert list((web["root"] / "bundles" / ".incoming").iterdir()) == []


def test_upload_over_the_limit_is_413_and_stores_nothing(web, tmp_path):
    path = big_bundle(tmp_path, LIMIT + 128 * 1024)
    before = sorted((web["root"] / "bundles").rglob("*.tar.gz"))
    try:
        status, body = post_file(web, path)
    except (BrokenPipeError, ConnectionResetError):
        status = None  # refused from the headers: the server closed before the whole body was sent
    if status is not None:
        assert status == 413 and "TRAINYARD_BUNDLE_MAX_BYTES" in body["errors"]["file"][0] or \
            "largest accepted" in body["errors"]["file"][0]
    assert sorted((web["root"] / "bundles").rglob("*.tar.gz")) == before


def test_oversized_body_is_refused_from_its_headers(web):
    conn = http.client.HTTPConnection("127.0.0.1", web["port"], timeout=10)
    conn.putrequest("POST", "/api/v1/code/")
    conn.putheader("Authorization", f"Token {web['token']}")
    conn.putheader("Content-Type", "multipart/form-data; boundary=x")
    conn.putheader("Content-Length", str(1000 * LIMIT))
    conn.endheaders()  # no body is ever sent: the answer must come from the headers alone
    started = time.monotonic()
    resp = conn.getresponse()
    body = json.loads(resp.read())
    assert resp.status == 413 and "the largest accepted is" in body["errors"]["file"][0]
    assert time.monotonic() - started < 5


def test_large_multipart_body_is_not_parsed_in_memory_by_the_server(web, tmp_path):
    """Twisted's own multipart parse (off) held a 48 MiB upload ~14x in memory."""
    path = big_bundle(tmp_path, LIMIT - 64 * 1024)
    server = psutil.Process(web["proc"].pid)
    before = server.memory_info().rss
    peak = [before]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], server.memory_info().rss)
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        for _ in range(3):
            assert post_file(web, path)[0] in (200, 201)
    finally:
        done.set()
        sampler.join()
    growth = peak[0] - before
    print(f"\ndaphne RSS grew {growth / 2**20:.1f} MiB over three {path.stat().st_size}-byte uploads")
    assert growth < 4 * path.stat().st_size


def test_upload_without_length_is_411(web):
    conn = http.client.HTTPConnection("127.0.0.1", web["port"], timeout=10)
    conn.putrequest("POST", "/api/v1/code/")
    conn.putheader("Authorization", f"Token {web['token']}")
    conn.putheader("Content-Type", "multipart/form-data; boundary=x")
    conn.putheader("Transfer-Encoding", "chunked")
    conn.endheaders()
    conn.send(b"5\r\nhello\r\n0\r\n\r\n")
    resp = conn.getresponse()
    payload = resp.read()
    assert resp.status == 411 and "Content-Length" in json.loads(payload)["errors"]["file"][0], payload


def test_malicious_upload_through_the_server_stores_nothing(web):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("../../escape.py")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "evil.tar.gz"
        path.write_bytes(gzip.compress(buf.getvalue()))
        before = sorted((web["root"] / "bundles").rglob("*.tar.gz")) if (web["root"] / "bundles").exists() else []
        status, body = post_file(web, path)
        assert status == 400 and "'..' component" in body["errors"]["file"][0]
        after = sorted((web["root"] / "bundles").rglob("*.tar.gz"))
        assert after == before


# ---------------------------------------------------------------- body limits per path (issue 21, section 6)

MIB = 1024 * 1024


def _headers_only(web, path: str, length: int, *, token: bool = True):
    conn = http.client.HTTPConnection("127.0.0.1", web["port"], timeout=10)
    conn.putrequest("POST", path)
    if token:
        conn.putheader("Authorization", f"Token {web['token']}")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(length))
    conn.endheaders()  # no body is ever sent: the answer must come from the headers alone
    started = time.monotonic()
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read() or b"{}"), time.monotonic() - started


def test_a_2_mib_body_elsewhere_is_413_before_it_is_sent(web):
    """Only /api/v1/code/ takes the bundle limit; every other path takes 1 MiB
    (TRAINYARD_HTTP_MAX_BODY_BYTES), decided from the headers, before authentication."""
    for path, token in (("/api/v1/jobs/", True), ("/api/v1/jobs/", False), ("/api/v1/auth/token/", False),
                        ("/api/v1/jobs/?x=/api/v1/code/", True), ("/api/v1/cod%65/x/", True)):
        status, body, took = _headers_only(web, path, 2 * MIB, token=token)
        assert status == 413, (path, status, body)
        assert "TRAINYARD_HTTP_MAX_BODY_BYTES" in body["errors"]["detail"][0] and took < 5, (path, body, took)
    # the code path decoded as daphne decodes it for Django: %63 is "c", the bundle limit applies
    status, body, _ = _headers_only(web, "/api/v1/%63ode/", 1000 * LIMIT)
    assert status == 413 and "TRAINYARD_BUNDLE_MAX_BYTES" in body["errors"]["file"][0]


def test_a_chunked_body_elsewhere_is_cut_off_past_1_mib(web):
    conn = http.client.HTTPConnection("127.0.0.1", web["port"], timeout=10)
    conn.putrequest("POST", "/api/v1/jobs/")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Transfer-Encoding", "chunked")
    conn.endheaders()
    size = MIB + 64 * 1024
    try:
        conn.send(b"%x\r\n" % size + b" " * size + b"\r\n")  # no terminating chunk: the server must not wait for it
        resp = conn.getresponse()
        status, payload = resp.status, resp.read()
    except (BrokenPipeError, ConnectionResetError):
        status, payload = None, b""  # refused while streaming, before the answer could be read
    assert status in (413, None), (status, payload)  # never handed to Django (a 401 from it)
    if status == 413:
        assert b"TRAINYARD_HTTP_MAX_BODY_BYTES" in payload


def test_the_code_path_still_takes_a_bundle_over_1_mib(web, tmp_path):
    path = big_bundle(tmp_path, 2 * MIB)
    assert path.stat().st_size > MIB
    status, body = post_file(web, path)
    assert status in (200, 201), body
