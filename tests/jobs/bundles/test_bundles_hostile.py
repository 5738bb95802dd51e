"""Code bundles through the API when the upload or the artifact root is hostile (issue 21, sections 5
and 6): a tree deeper than TRAINYARD_BUNDLE_MAX_DEPTH is a 400 naming the limit; the store, the
stored check, delete and the garbage collector never follow a link a job planted under the artifact
root (the root is shared with the nodes) and only ever write or delete inside it."""
from __future__ import annotations

import gzip
import hashlib
import os
import tarfile
import time

import pytest

from jobs import services
from jobs.models import CodeBundle
from tests.jobs.bundles.test_bundles import client, targz, upload  # noqa: F401 (fixture)
from tests.test_bundle import GOOD, member, tar_bytes
from trainyard import keys

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def artifacts(settings, tmp_path):
    settings.TRAINYARD_ARTIFACT_ROOT = tmp_path / "artifacts"
    return settings.TRAINYARD_ARTIFACT_ROOT


@pytest.fixture
def outside(tmp_path):
    d = tmp_path / "outside"
    d.mkdir()
    (d / "keep").write_text("not the store's")
    return d


def test_a_bundle_deeper_than_the_limit_is_400_naming_it(client, artifacts, settings):  # noqa: F811
    deep = "/".join(["a"] * 1500) + "/train.py"
    r = upload(client, gzip.compress(tar_bytes([member(deep, b"x")], fmt=tarfile.GNU_FORMAT)))
    assert r.status_code == 400, r.content
    message = r.json()["errors"]["file"][0]
    assert "path components deep" in message and "TRAINYARD_BUNDLE_MAX_DEPTH" in message
    assert CodeBundle.objects.count() == 0
    settings.TRAINYARD_BUNDLE_MAX_DEPTH = 3
    r = upload(client, targz([member("a/b/c/d.py", b"x")]))
    assert r.status_code == 400 and "4 path components deep; the limit is 3" in r.json()["errors"]["file"][0]
    assert upload(client, targz([member("a/b/c.py", b"x")])).status_code == 201


def test_a_stored_bundle_replaced_by_a_link_is_not_stored_and_is_replaced(client, artifacts, outside):  # noqa: F811
    data = targz(GOOD)
    digest = upload(client, data).json()["bundle"]
    stored = keys.bundle_path(artifacts, digest)
    os.chmod(stored, 0o644)
    stored.unlink()
    stored.symlink_to(outside / "keep")
    assert services.bundle_files(digest) is None  # the submit check does not follow it
    again = upload(client, data)
    assert again.status_code == 200, again.content
    assert not stored.is_symlink() and stored.read_bytes() == data
    assert (outside / "keep").read_text() == "not the store's"
    assert services.bundle_files(digest)


def test_a_bucket_directory_replaced_by_a_link_is_never_written_through(client, artifacts, outside):  # noqa: F811
    data = targz(GOOD)
    hexdigest = hashlib.sha256(data).hexdigest()
    (artifacts / "bundles").mkdir(parents=True)
    (artifacts / "bundles" / hexdigest[:2]).symlink_to(outside)
    r = upload(client, data)
    assert r.status_code == 503 and "bundle store" in r.json()["errors"]["file"][0]
    assert sorted(os.listdir(outside)) == ["keep"] and CodeBundle.objects.count() == 0
    assert os.listdir(artifacts / "bundles" / ".incoming") == []


def test_an_incoming_directory_replaced_by_a_link_is_never_written_through(client, artifacts, outside):  # noqa: F811
    (artifacts / "bundles").mkdir(parents=True)
    (artifacts / "bundles" / ".incoming").symlink_to(outside)
    r = upload(client, targz(GOOD))
    assert r.status_code == 503, r.content
    assert sorted(os.listdir(outside)) == ["keep"] and CodeBundle.objects.count() == 0


def test_delete_and_gc_never_delete_through_a_link(client, artifacts, outside):  # noqa: F811
    # delete of a row whose file is a link: the link goes, not its target
    digest2 = upload(client, targz([member("other.py", b"y")])).json()["bundle"]
    stored2 = keys.bundle_path(artifacts, digest2)
    os.chmod(stored2, 0o644)
    stored2.unlink()
    stored2.symlink_to(outside / "keep")
    services.bundle_delete(CodeBundle.objects.get(digest=digest2))
    assert not os.path.lexists(stored2) and (outside / "keep").read_text() == "not the store's"
    # the GC: an orphan "bundle" in a bucket that is a link, an old upload behind a linked .incoming/,
    # and a stored bundle (its row lost) replaced by a link to a file outside
    digest = upload(client, targz(GOOD)).json()["bundle"]
    # a bucket neither real upload uses (a digest starts with "ff" about once in 128 runs)
    bucket = next(b for b in ("ff", "fe", "fd") if b not in (digest[:2], digest2[:2]))
    fake = bucket + "0" * 62
    os.link(outside / "keep", outside / f"{fake}.tar.gz")
    (artifacts / "bundles" / bucket).symlink_to(outside)
    old = time.time() - 30 * 86400
    os.utime(outside / f"{fake}.tar.gz", (old, old))
    incoming = artifacts / "bundles" / ".incoming"
    os.rmdir(incoming)
    incoming.symlink_to(outside)
    os.utime(outside / "keep", (old, old))
    stored = keys.bundle_path(artifacts, digest)
    os.chmod(stored, 0o644)
    stored.unlink()
    stored.symlink_to(outside / "keep")
    CodeBundle.objects.all().delete()
    os.utime(stored, (old, old), follow_symlinks=False)
    result = services.bundles_gc(age_s=3600)
    assert (outside / "keep").read_text() == "not the store's" and (outside / f"{fake}.tar.gz").exists()
    assert result.stale_uploads == 0 and result.orphan_files == 1  # the link itself, as an orphan
    assert not os.path.lexists(stored)
