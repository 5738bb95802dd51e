"""Code bundles through the API, the services, the admin and the garbage collector: uploads are
stored once, content-addressed and read-only; every bad upload is a 4xx naming the problem with
nothing stored (no row, no file, no temporary left in .incoming/)."""
from __future__ import annotations

import asyncio
import gzip
import hashlib
import io
import os
import stat
import tarfile
import time
from pathlib import Path

import pytest
from django.core.management import call_command
from django.utils import timezone
from rest_framework.test import APIClient

from jobs.bundles import services as bundle_services
from jobs.access import services as access_services
from jobs import services, tasks
from jobs.bundles.api import MULTIPART_OVERHEAD, UploadSizeGuard
from jobs.models import CodeBundle, Job
from tests.test_bundle import GOOD, member, tar_bytes
from trainyard import keys
from trainyard.launch import BUNDLES_GC_TASK

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def artifacts(settings, tmp_path):
    settings.TRAINYARD_ARTIFACT_ROOT = tmp_path / "artifacts"
    return settings.TRAINYARD_ARTIFACT_ROOT


@pytest.fixture
def client(user):
    c = APIClient()
    c.credentials(HTTP_AUTHORIZATION=f"Token {access_services.token_issue(user)}")
    return c


def targz(members) -> bytes:
    return gzip.compress(tar_bytes(members))


def upload(client, data: bytes, name="code.tar.gz", field="file"):
    return client.post("/api/v1/code/", {field: io.BytesIO(data) if name is None else _named(data, name)},
                       format="multipart")


def _named(data: bytes, name: str) -> io.BytesIO:
    f = io.BytesIO(data)
    f.name = name
    return f


def stored_files(root: Path) -> list[Path]:
    bundles = root / "bundles"
    return sorted(p for p in bundles.rglob("*") if p.is_file()) if bundles.exists() else []


def assert_nothing_stored(root: Path) -> None:
    assert CodeBundle.objects.count() == 0
    assert stored_files(root) == []


def test_upload_stores_content_addressed_read_only(client, user, artifacts):
    data = targz(GOOD)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    r = upload(client, data)
    assert r.status_code == 201, r.content
    assert r.json() == {"bundle": digest, "bytes": len(data), "files": 4}
    path = keys.bundle_path(artifacts, digest)
    assert path.read_bytes() == data and stat.S_IMODE(path.stat().st_mode) == 0o444
    assert stored_files(artifacts) == [path]  # the upload's temporary is gone
    row = CodeBundle.objects.get()
    assert (row.digest, row.owner, row.files) == (digest, user, 4)
    assert row.file_list == ["copy.py", "pkg/__init__.py", "run.sh", "train.py"] and row.last_used_at
    assert services.bundle_files(digest) == frozenset(row.file_list)
    detail = client.get(f"/api/v1/code/{digest}/")
    assert detail.status_code == 200 and detail.json()["bundle"] == digest and detail.json()["files"] == 4


def test_same_bundle_again_is_200_and_stored_once(client, other, artifacts):
    data = targz(GOOD)
    first = upload(client, data)
    CodeBundle.objects.update(last_used_at=None)
    inode = keys.bundle_path(artifacts, first.json()["bundle"]).stat().st_ino
    bob = APIClient()
    bob.force_authenticate(other)
    again = upload(bob, data)
    assert again.status_code == 200 and again.json() == first.json()
    assert CodeBundle.objects.count() == 1 and CodeBundle.objects.get().last_used_at is not None
    assert keys.bundle_path(artifacts, first.json()["bundle"]).stat().st_ino == inode
    assert len(stored_files(artifacts)) == 1


def test_a_stored_row_whose_file_vanished_is_restored(client, artifacts):
    data = targz(GOOD)
    digest = upload(client, data).json()["bundle"]
    path = keys.bundle_path(artifacts, digest)
    os.chmod(path, 0o644)
    path.unlink()
    assert services.bundle_files(digest) is None
    assert upload(client, data).status_code == 200
    assert path.read_bytes() == data and services.bundle_files(digest)


MALICIOUS = [
    ("absolute path", [member("/etc/evil", b"x")], "absolute path"),
    ("dotdot", [member("../evil.py", b"x")], "'..' component"),
    ("symlink out", [member("ok.py", b""), member("l", type_=tarfile.SYMTYPE, linkname="../../etc")],
     "points outside"),
    ("hardlink out", [member("ok.py", b""), member("h", type_=tarfile.LNKTYPE, linkname="/etc/passwd")],
     "absolute path"),
    ("device", [member("ok.py", b""), member("d", type_=tarfile.CHRTYPE)], "character device"),
    ("fifo", [member("ok.py", b""), member("p", type_=tarfile.FIFOTYPE)], "FIFO"),
    ("duplicate", [member("a.py", b"1"), member("a.py", b"2")], "appears twice"),
]


@pytest.mark.parametrize("case, members, fragment", MALICIOUS, ids=[m[0] for m in MALICIOUS])
def test_malicious_bundles_are_400_and_nothing_is_stored(client, artifacts, case, members, fragment):
    r = upload(client, targz(members))
    assert r.status_code == 400, r.content
    assert list(r.json()) == ["errors"] and fragment in r.json()["errors"]["file"][0]
    assert_nothing_stored(artifacts)


def test_not_gzip_and_not_tar_are_400(client, artifacts):
    for data, fragment in ((tar_bytes(GOOD), "not a gzip file"), (b"PK\x03\x04zip", "not a gzip file"),
                           (gzip.compress(b"just text"), "not a valid tar archive")):
        r = upload(client, data)
        assert r.status_code == 400 and fragment in r.json()["errors"]["file"][0], r.content
    assert_nothing_stored(artifacts)


def test_size_limits_are_413(client, settings, artifacts):
    settings.TRAINYARD_BUNDLE_MAX_BYTES = 16 * 1024
    # over the packed limit while streaming (the request's length is within the multipart slack)
    r = upload(client, targz([member("noise.bin", os.urandom(32 * 1024))]))
    assert r.status_code == 413 and "over 16384 bytes packed" in r.json()["errors"]["file"][0]
    # a Content-Length far over the limit: refused before the body is read
    r = upload(client, targz([member("noise.bin", os.urandom(16 * 1024 + MULTIPART_OVERHEAD + 1024))]))
    assert r.status_code == 413 and "TRAINYARD_BUNDLE_MAX_BYTES" in r.json()["errors"]["file"][0]
    settings.TRAINYARD_BUNDLE_MAX_BYTES = 100 * 1024 * 1024
    settings.TRAINYARD_BUNDLE_MAX_UNPACKED_BYTES = 1024 * 1024
    r = upload(client, targz([member("zeros.bin", b"\0" * 2 * 1024 * 1024)]))  # a 2 KiB gzip bomb
    assert r.status_code == 413 and "over 1048576 bytes" in r.json()["errors"]["file"][0]
    settings.TRAINYARD_BUNDLE_MAX_FILES = 3
    r = upload(client, targz([member(f"f{i}.py", b"") for i in range(4)]))
    assert r.status_code == 413 and "more than 3 members" in r.json()["errors"]["file"][0]
    assert_nothing_stored(artifacts)


def test_wrong_shape_requests_are_refused(client, artifacts):
    data = targz(GOOD)
    r = upload(client, data, field="code")
    assert r.status_code == 400 and "multipart field 'file'" in r.json()["errors"]["file"][0]
    r = client.post("/api/v1/code/", {"file": [_named(data, "a.tar.gz"), _named(data, "b.tar.gz")]},
                    format="multipart")
    assert r.status_code == 400 and "exactly one" in r.json()["errors"]["file"][0]
    r = client.post("/api/v1/code/", {"file": "not a file"}, format="multipart")
    assert r.status_code == 400
    r = client.post("/api/v1/code/", {"file": "x"}, format="json")
    assert r.status_code == 415
    assert_nothing_stored(artifacts)


def test_login_required(user, artifacts):
    anonymous = APIClient()
    assert upload(anonymous, targz(GOOD)).status_code == 401
    digest = "sha256:" + "a" * 64
    assert anonymous.get(f"/api/v1/code/{digest}/").status_code == 401
    # a session without its CSRF token: refused, and the body it read is not kept
    session = APIClient(enforce_csrf_checks=True)
    session.force_login(user)
    session.cookies["csrftoken"] = "a" * 32  # a cookie, no token: the check reads the form for one
    assert upload(session, targz(GOOD)).status_code == 403
    assert_nothing_stored(artifacts)
    incoming = artifacts / "bundles" / ".incoming"  # the CSRF check read the body through the handler
    assert incoming.is_dir() and list(incoming.iterdir()) == []
    # the same session with its token uploads (the body read once, by the CSRF check, through the handler)
    r = session.post("/api/v1/code/", {"file": _named(targz(GOOD), "c.tar.gz")}, format="multipart",
                     HTTP_X_CSRFTOKEN="a" * 32)
    assert r.status_code == 201, r.content


def test_detail_of_unknown_or_malformed_digest_is_404(client):
    assert client.get("/api/v1/code/sha256:" + "0" * 64 + "/").status_code == 404
    r = client.get("/api/v1/code/nonsense/")
    assert r.status_code == 404 and "not a bundle id" in r.json()["errors"]["bundle"][0]


def test_bundle_files_is_the_submit_check(client):
    digest = upload(client, targz(GOOD)).json()["bundle"]
    CodeBundle.objects.update(last_used_at=None)
    assert "train.py" in services.bundle_files(digest) and "pkg/alias.py" not in services.bundle_files(digest)
    assert CodeBundle.objects.get().last_used_at is not None  # a submit marks it used
    assert services.bundle_files("sha256:" + "1" * 64) is None
    assert services.bundle_files("train.py") is None


def test_upload_size_guard_answers_before_the_body():
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["path"])

    async def call(path, headers):
        sent = []

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
        await UploadSizeGuard(app, 1000)(scope, None, send)
        return sent

    over = asyncio.run(call("/api/v1/code/", [(b"content-length", str(1001 + MULTIPART_OVERHEAD).encode())]))
    assert over[0]["status"] == 413 and b"TRAINYARD_BUNDLE_MAX_BYTES" in over[1]["body"]
    assert asyncio.run(call("/api/v1/code/", []))[0]["status"] == 411
    assert asyncio.run(call("/api/v1/code/", [(b"content-length", b"900")])) == []
    assert asyncio.run(call("/api/v1/jobs/", [])) == []
    assert seen == ["/api/v1/code/", "/api/v1/jobs/"]


# ---------------------------------------------------------------- admin


def test_staff_see_and_delete_bundles_in_the_admin(client, staff, user, artifacts):
    digest = upload(client, targz(GOOD)).json()["bundle"]
    bundle = CodeBundle.objects.get()
    admin = APIClient()
    admin.force_login(staff)  # staff without explicit model permissions
    listing = admin.get("/admin/jobs/codebundle/")
    assert listing.status_code == 200 and digest in listing.content.decode()
    r = admin.post(f"/admin/jobs/codebundle/{bundle.pk}/delete/", {"post": "yes"})
    assert r.status_code == 302
    assert_nothing_stored(artifacts)
    plain = APIClient()
    plain.force_login(user)
    assert plain.get("/admin/jobs/codebundle/").status_code == 302  # to the admin login


# ---------------------------------------------------------------- garbage collection


def _age(digest: str, days: float) -> None:
    then = timezone.now() - timezone.timedelta(days=days)
    CodeBundle.objects.filter(digest=digest).update(created_at=then, last_used_at=then)


def test_gc_deletes_only_unreferenced_bundles_unused_for_the_age(client, user, artifacts, settings):
    settings.TRAINYARD_BUNDLE_GC_AGE_S = 7 * 86400
    old = upload(client, targz([member("old.py", b"1")])).json()["bundle"]
    used = upload(client, targz([member("used.py", b"2")])).json()["bundle"]
    fresh = upload(client, targz([member("fresh.py", b"3")])).json()["bundle"]
    for digest in (old, used):
        _age(digest, 8)
    Job.objects.create(name="j", owner=user, spec={"code": {"bundle": used}}, slots=1, status="SUCCEEDED")
    Job.objects.create(name="builtin", owner=user, spec={"model": {"kind": "gpt"}}, slots=1)
    result = services.bundles_gc()
    assert result.deleted == [old] and result.freed_bytes > 0
    assert set(CodeBundle.objects.values_list("digest", flat=True)) == {used, fresh}
    assert not keys.bundle_path(artifacts, old).exists()
    assert keys.bundle_path(artifacts, used).exists() and keys.bundle_path(artifacts, fresh).exists()
    # a submit marks a bundle used: an old one is kept again for the whole age
    _age(fresh, 8)
    assert services.bundle_files(fresh)
    assert services.bundles_gc().deleted == []


def test_gc_sweeps_orphan_files_and_abandoned_uploads(client, artifacts):
    digest = upload(client, targz(GOOD)).json()["bundle"]
    CodeBundle.objects.all().delete()  # the row lost: the file is an orphan
    path = keys.bundle_path(artifacts, digest)
    stale = bundle_services.incoming_dir() / "upload-crashed.tar.gz"
    stale.write_bytes(b"partial")
    live = bundle_services.incoming_dir() / "upload-live.tar.gz"
    live.write_bytes(b"arriving")
    assert services.bundles_gc().orphan_files == 0  # younger than the age
    two_hours_ago = time.time() - 7200
    for p in (path, stale):
        os.utime(p, (two_hours_ago, two_hours_ago), follow_symlinks=False)
    result = services.bundles_gc(age_s=3600)
    assert (result.orphan_files, result.stale_uploads) == (1, 1)
    assert not path.exists() and not stale.exists() and live.exists()


def test_gc_command_task_and_beat(client, artifacts, capsys):
    digest = upload(client, targz(GOOD)).json()["bundle"]
    call_command("bundles_gc")
    assert "0 bundle(s)" in capsys.readouterr().out and CodeBundle.objects.count() == 1
    _age(digest, 1)
    call_command("bundles_gc", "--age-s", "3600")
    assert f"deleted {digest}" in capsys.readouterr().out
    assert_nothing_stored(artifacts)
    digest = upload(client, targz(GOOD)).json()["bundle"]
    _age(digest, 30)
    assert tasks.bundles_gc() == [digest]
    assert tasks.bundles_gc.name == BUNDLES_GC_TASK
    from controlplane.celery import app

    assert any(e["task"] == BUNDLES_GC_TASK for e in app.conf.beat_schedule.values())
