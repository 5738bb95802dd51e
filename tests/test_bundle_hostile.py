"""trainyard.bundle against bundles built to crash the node rather than to escape (issue 21, section 6),
and bundle files a job replaced by links: a tree deeper than TRAINYARD_BUNDLE_MAX_DEPTH is refused at
inspection and again at extraction, quickly, with a BundleError; an OSError or RecursionError met
while unpacking (a full disk, a name too long for the filesystem) is a BundleError, with nothing left
behind; the bundle file itself is never read through a symlink, a FIFO or a linked directory."""
from __future__ import annotations

import errno
import gzip
import os
import tarfile
import threading
import time

import pytest

from tests.test_bundle import GOOD, digest_of, member, tar_bytes, write
from trainyard import bundle as bundle_mod
from trainyard import keys, safefs
from trainyard.bundle import BundleError, BundleLimits, extract_bundle, inspect_bundle
from workers import entrypoint

DEEP = "/".join(["a"] * 1500) + "/train.py"


def deep_bundle(tmp_path, depth: int, *, with_dirs: bool = False):
    parts = ["d"] * (depth - 1)
    members = [member("/".join(parts[:i]) + "/", type_=tarfile.DIRTYPE) for i in range(1, depth)] if with_dirs else []
    members.append(member("/".join(parts + ["train.py"]), b"print(1)\n"))
    return write(tmp_path, raw=gzip.compress(tar_bytes(members, fmt=tarfile.GNU_FORMAT)), name=f"deep-{depth}.tar.gz")


def assert_nothing_left(parent) -> None:
    assert not parent.exists() or list(parent.iterdir()) == [], "a refused extraction left files behind"


def test_a_bundle_1500_directories_deep_is_refused_at_inspection_and_extraction(tmp_path):
    path = write(tmp_path, raw=gzip.compress(tar_bytes([member(DEEP, b"x")], fmt=tarfile.GNU_FORMAT)))
    with pytest.raises(BundleError) as inspected:
        inspect_bundle(path)
    assert inspected.value.status == 400 and "1501 path components deep" in inspected.value.message
    assert "TRAINYARD_BUNDLE_MAX_DEPTH" in inspected.value.message
    t0 = time.monotonic()
    with pytest.raises(BundleError, match="path components deep"):
        extract_bundle(path, tmp_path / "run" / "code", digest=digest_of(path))
    assert time.monotonic() - t0 < 5
    assert_nothing_left(tmp_path / "run")


@pytest.mark.parametrize("with_dirs", [False, True], ids=["files only", "with directory members"])
def test_the_depth_limit_is_exact_and_configurable(tmp_path, with_dirs):
    at_limit = deep_bundle(tmp_path, 64, with_dirs=with_dirs)
    info = extract_bundle(at_limit, tmp_path / "ok" / "code", digest=digest_of(at_limit))
    assert info.files == 1 and (tmp_path / "ok" / "code" / ("d/" * 63 + "train.py")).is_file()
    over = deep_bundle(tmp_path, 65, with_dirs=with_dirs)
    with pytest.raises(BundleError, match="65 path components deep; the limit is 64"):
        inspect_bundle(over)
    with pytest.raises(BundleError, match="65 path components deep"):
        extract_bundle(over, tmp_path / "no" / "code", digest=digest_of(over))
    assert_nothing_left(tmp_path / "no")
    assert inspect_bundle(over, limits=BundleLimits(max_depth=65)).files == 1
    assert BundleLimits.from_env({"TRAINYARD_BUNDLE_MAX_DEPTH": "8"}).max_depth == 8
    assert BundleLimits.from_env({}).max_depth == 64
    with pytest.raises(ValueError, match="TRAINYARD_BUNDLE_MAX_DEPTH must be a positive integer"):
        BundleLimits.from_env({"TRAINYARD_BUNDLE_MAX_DEPTH": "deep"})


def test_a_full_disk_during_extraction_is_a_bundle_error(tmp_path, monkeypatch):
    path = write(tmp_path, GOOD)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(bundle_mod.shutil, "copyfileobj", no_space)
    with pytest.raises(BundleError, match="No space left on device"):
        extract_bundle(path, tmp_path / "run" / "code", digest=digest_of(path))
    assert_nothing_left(tmp_path / "run")


def test_a_recursion_error_during_extraction_is_a_bundle_error(tmp_path, monkeypatch):
    path = write(tmp_path, GOOD)

    def too_deep(*args, **kwargs):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(bundle_mod.os, "walk", too_deep)
    with pytest.raises(BundleError, match="too deep to unpack"):
        extract_bundle(path, tmp_path / "run" / "code", digest=digest_of(path))


def test_a_name_too_long_for_the_filesystem_where_it_lands_is_a_bundle_error(tmp_path):
    """Each component under 255 bytes and the whole name under 4,000 passes inspection; below a long
    run directory the full path passes PATH_MAX and the kernel refuses it (ENAMETOOLONG)."""
    name = "/".join(["n" * 240] * 15) + "/x.py"
    path = write(tmp_path, raw=gzip.compress(tar_bytes([member(name, b"x")], fmt=tarfile.GNU_FORMAT)))
    assert inspect_bundle(path).files == 1
    run = tmp_path / ("r" * 200) / ("r" * 200)
    run.mkdir(parents=True)
    with pytest.raises(BundleError, match="cannot be unpacked here"):
        extract_bundle(path, run / "code", digest=digest_of(path))
    assert_nothing_left(run)


def test_a_bundle_file_that_is_a_symlink_or_a_fifo_is_refused(tmp_path):
    real = write(tmp_path, GOOD)
    (tmp_path / "link.tar.gz").symlink_to(real)
    for how in (inspect_bundle, lambda p: extract_bundle(p, tmp_path / "run" / "code", digest=digest_of(real))):
        with pytest.raises(BundleError, match="symlink or not a file"):
            how(tmp_path / "link.tar.gz")
    os.mkfifo(tmp_path / "fifo.tar.gz")
    done = threading.Event()

    def read():
        with pytest.raises(BundleError, match="not a regular file"):
            inspect_bundle(tmp_path / "fifo.tar.gz")
        done.set()

    threading.Thread(target=read, daemon=True).start()
    assert done.wait(5), "a FIFO in place of a bundle blocked the reader"


def test_open_stored_follows_no_link_below_the_artifact_root(tmp_path):
    root = tmp_path / "artifacts"
    data_path = write(tmp_path, GOOD)
    digest = digest_of(data_path)
    stored = keys.bundle_path(root, digest)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.link(data_path, elsewhere / stored.name)
    (root / "bundles").mkdir(parents=True)
    (root / "bundles" / stored.parent.name).symlink_to(elsewhere)  # the bucket directory is a link
    with pytest.raises(safefs.UnsafePath):
        bundle_mod.open_stored(root, digest)
    (root / "bundles" / stored.parent.name).unlink()
    stored.parent.mkdir()
    stored.symlink_to(data_path)  # the bundle file is a link
    with pytest.raises(safefs.UnsafePath):
        bundle_mod.open_stored(root, digest)
    stored.unlink()
    os.link(data_path, stored)
    fd = bundle_mod.open_stored(root, digest)
    try:
        assert inspect_bundle(fd).digest == digest
        assert extract_bundle(fd, tmp_path / "run" / "code", digest=digest).files == 4
    finally:
        os.close(fd)


# ---------------------------------------------------------------- on the node (workers/entrypoint.py)


def _store(root, path) -> str:
    digest = digest_of(path)
    target = keys.bundle_path(root, digest)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(path.read_bytes())
    return digest


@pytest.fixture
def artifacts(tmp_path, monkeypatch):
    root = tmp_path / "artifacts"
    monkeypatch.setenv("TRAINYARD_ARTIFACT_ROOT", str(root))
    return root


def test_the_node_reports_a_deep_bundle_as_a_user_error_at_once(tmp_path, artifacts):
    digest = _store(artifacts, write(tmp_path, raw=gzip.compress(tar_bytes([member(DEEP, b"x")],
                                                                           fmt=tarfile.GNU_FORMAT))))
    t0 = time.monotonic()
    with pytest.raises(entrypoint.UserCodeError) as exc:
        entrypoint.unpack(digest, tmp_path / "run", node="node-a")
    assert time.monotonic() - t0 < 5
    assert str(exc.value).startswith("BundleError: ") and "path components deep" in str(exc.value)
    assert not (tmp_path / "run" / "code").exists()


def test_the_node_refuses_a_stored_bundle_replaced_by_a_link(tmp_path, artifacts):
    good = write(tmp_path, GOOD)
    digest = _store(artifacts, good)
    stored = keys.bundle_path(artifacts, digest)
    stored.unlink()
    stored.symlink_to(good)
    with pytest.raises(entrypoint.UserCodeError) as exc:
        entrypoint.unpack(digest, tmp_path / "run", node="node-a")
    assert str(exc.value).startswith("BundleError: ") and "refused" in str(exc.value)
    assert not (tmp_path / "run" / "code").exists()
