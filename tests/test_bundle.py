"""trainyard.bundle against crafted archives: every malicious or broken bundle is refused with its
own message and status by both inspect_bundle and extract_bundle, and extraction leaves nothing
behind; good bundles unpack read-only, in bounded memory."""
from __future__ import annotations

import gzip
import hashlib
import io
import os
import stat
import tarfile
import tracemalloc
from pathlib import Path

import pytest

from trainyard import keys
from trainyard.bundle import (
    MAX_EXTENDED_HEADER,
    BundleError,
    BundleLimits,
    extract_bundle,
    inspect_bundle,
    is_digest,
    remove_tree,
)


def member(name: str, data: bytes = b"", *, type_=tarfile.REGTYPE, linkname: str = "", mode: int = 0o644,
           pax: dict[str, str] | None = None) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = type_, linkname, mode
    info.size = len(data) if type_ in (tarfile.REGTYPE, tarfile.AREGTYPE) else 0
    if pax:
        info.pax_headers = pax
    return info, data


def tar_bytes(members, *, fmt=tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buf.getvalue()


def write(tmp_path: Path, members=None, *, raw: bytes | None = None, name="b.tar.gz") -> Path:
    path = tmp_path / name
    path.write_bytes(raw if raw is not None else gzip.compress(tar_bytes(members)))
    return path


def digest_of(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


GOOD = [member("train.py", b"print('hi')\n"), member("pkg/", type_=tarfile.DIRTYPE),
        member("pkg/__init__.py", b""), member("run.sh", b"#!/bin/sh\n", mode=0o755),
        member("pkg/alias.py", type_=tarfile.SYMTYPE, linkname="../train.py"),
        member("copy.py", type_=tarfile.LNKTYPE, linkname="train.py")]


def assert_refused(tmp_path: Path, path: Path, fragment: str, status: int = 400, limits=None) -> None:
    with pytest.raises(BundleError) as inspected:
        inspect_bundle(path, limits=limits)
    assert fragment in inspected.value.message and inspected.value.status == status
    dest_parent = tmp_path / "run"
    dest_parent.mkdir(exist_ok=True)
    with pytest.raises(BundleError) as extracted:
        extract_bundle(path, dest_parent / "code", digest=digest_of(path), limits=limits)
    assert fragment in extracted.value.message and extracted.value.status == status
    assert list(dest_parent.iterdir()) == [], "a refused extraction left files behind"


def test_good_bundle_inspects_and_extracts_read_only(tmp_path):
    path = write(tmp_path, GOOD)
    info = inspect_bundle(path)
    assert info.digest == digest_of(path) and is_digest(info.digest)
    assert info.bytes == path.stat().st_size
    assert info.files == 4 and info.names == ("copy.py", "pkg/__init__.py", "run.sh", "train.py")
    dest = tmp_path / "run" / "code"
    assert extract_bundle(path, dest, digest=info.digest) == info
    assert (dest / "train.py").read_text() == "print('hi')\n"
    assert (dest / "pkg" / "alias.py").read_text() == "print('hi')\n"
    assert os.readlink(dest / "pkg" / "alias.py") == "../train.py"
    assert (dest / "copy.py").stat().st_ino == (dest / "train.py").stat().st_ino
    assert stat.S_IMODE((dest / "train.py").stat().st_mode) == 0o444
    assert stat.S_IMODE((dest / "run.sh").stat().st_mode) == 0o555
    assert stat.S_IMODE((dest / "pkg").stat().st_mode) == 0o555
    assert stat.S_IMODE(dest.stat().st_mode) == 0o555
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["code"]  # no temp dir left
    remove_tree(dest)
    assert not dest.exists()


def test_extract_refuses_existing_destination_and_bad_digest_argument(tmp_path):
    path = write(tmp_path, GOOD)
    (tmp_path / "code").mkdir()
    with pytest.raises(FileExistsError):
        extract_bundle(path, tmp_path / "code", digest=digest_of(path))
    with pytest.raises(BundleError, match="is not a bundle id"):
        extract_bundle(path, tmp_path / "other", digest="md5:abc")


def test_missing_bundle_file(tmp_path):
    with pytest.raises(BundleError, match="does not exist"):
        extract_bundle(tmp_path / "gone.tar.gz", tmp_path / "code", digest="sha256:" + "0" * 64)
    assert list(tmp_path.iterdir()) == []


def test_extract_verifies_the_hash(tmp_path):
    path = write(tmp_path, GOOD)
    run = tmp_path / "run"
    with pytest.raises(BundleError, match="expected sha256:0000"):
        extract_bundle(path, run / "code", digest="sha256:" + "0" * 64)
    assert list(run.iterdir()) == []


@pytest.mark.parametrize("name, members, fragment", [
    ("absolute", [member("/etc/cron.d/x", b"x")], "has an absolute path"),
    ("dotdot", [member("a/../../evil.py", b"x")], "has a '..' component"),
    ("dotdot-dir", [member("../", type_=tarfile.DIRTYPE), member("ok.py", b"")], "has a '..' component"),
    ("symlink-absolute", [member("ok.py", b""), member("l", type_=tarfile.SYMTYPE, linkname="/etc/passwd")],
     "points to an absolute path"),
    ("symlink-outside", [member("ok.py", b""), member("d/l", type_=tarfile.SYMTYPE, linkname="../../x")],
     "points outside the bundle"),
    # `b` -> "." makes "b/.." the bundle's parent for the kernel, though the name alone looks inside
    ("symlink-through-link", [member("ok.py", b""), member("b", type_=tarfile.SYMTYPE, linkname="."),
                              member("a", type_=tarfile.SYMTYPE, linkname="b/../../x")], "points outside"),
    ("symlink-loop", [member("ok.py", b""), member("a", type_=tarfile.SYMTYPE, linkname="b/x"),
                      member("b", type_=tarfile.SYMTYPE, linkname="a/y")], "points outside"),
    ("hardlink-outside", [member("ok.py", b""), member("h", type_=tarfile.LNKTYPE, linkname="../etc/passwd")],
     "has a '..' component"),
    ("hardlink-unknown", [member("h", type_=tarfile.LNKTYPE, linkname="nope.py"), member("ok.py", b"")],
     "not a regular file earlier in the bundle"),
    ("chardev", [member("ok.py", b""), member("dev", type_=tarfile.CHRTYPE)], "is a character device"),
    ("blockdev", [member("ok.py", b""), member("dev", type_=tarfile.BLKTYPE)], "is a block device"),
    ("fifo", [member("ok.py", b""), member("pipe", type_=tarfile.FIFOTYPE)], "is a FIFO"),
    ("contiguous", [member("c.py", b"x", type_=tarfile.CONTTYPE)], "is a contiguous file"),
    ("duplicate", [member("a.py", b"1"), member("a.py", b"2")], "appears twice"),
    ("duplicate-normalized", [member("a.py", b"1"), member("./x/../a.py", b"2")], "'..' component"),
    ("duplicate-dot", [member("a.py", b"1"), member("./a.py", b"2")], "appears twice"),
    ("file-then-inside", [member("a", b"1"), member("a/b.py", b"2")], "which is not a directory"),
    ("inside-then-file", [member("a/b.py", b"2"), member("a", b"1")], "other members lie inside it"),
    ("under-symlink", [member("sub/", type_=tarfile.DIRTYPE), member("l", type_=tarfile.SYMTYPE, linkname="sub"),
                       member("l/x.py", b"x")], "which is not a directory"),
    ("empty", [member("d/", type_=tarfile.DIRTYPE)], "holds no files"),
])
def test_malicious_members_are_refused(tmp_path, name, members, fragment):
    assert_refused(tmp_path, write(tmp_path, members), fragment)


def test_not_gzip_not_tar_truncated_and_trailing_data(tmp_path):
    plain_tar = tar_bytes(GOOD)
    assert_refused(tmp_path, write(tmp_path, raw=plain_tar, name="a"), "not a gzip file")
    assert_refused(tmp_path, write(tmp_path, raw=b"", name="b"), "not a gzip file")
    assert_refused(tmp_path, write(tmp_path, raw=gzip.compress(b"hello world " * 100), name="c"),
                   "not a valid tar archive")
    packed = gzip.compress(plain_tar)
    assert_refused(tmp_path, write(tmp_path, raw=packed[: len(packed) // 2], name="d"), "corrupt or truncated")
    corrupt = bytearray(packed)
    corrupt[-8] ^= 0xFF  # the gzip trailer's CRC
    assert_refused(tmp_path, write(tmp_path, raw=bytes(corrupt), name="e"), "corrupt or truncated")
    trailing = gzip.compress(plain_tar + b"\x00" * 512 + b"garbage" + b"\x00" * 505)
    assert_refused(tmp_path, write(tmp_path, raw=trailing, name="f"), "data after the end")


def test_size_limits_are_413(tmp_path):
    many = [member(f"f{i}.py", b"") for i in range(6)]
    assert_refused(tmp_path, write(tmp_path, many, name="a"), "more than 5 members", 413, BundleLimits(max_files=5))
    big = [member("big.bin", os.urandom(64 * 1024))]
    assert_refused(tmp_path, write(tmp_path, big, name="b"), "bytes packed", 413, BundleLimits(max_bytes=32 * 1024))
    # declared sizes over the unpacked limit: refused from the header, before the data is read
    zeros = [member("zeros.bin", b"\x00" * (2 * 1024 * 1024))]
    assert_refused(tmp_path, write(tmp_path, zeros, name="c"), "add up to over", 413,
                   BundleLimits(max_unpacked=1024 * 1024))


def test_unpacked_bytes_are_counted_not_taken_from_headers(tmp_path):
    # 200 empty files declare 0 bytes, but their headers decompress to ~100 KiB
    empties = [member(f"e{i}.py") for i in range(200)]
    assert_refused(tmp_path, write(tmp_path, empties, name="a"), "unpacks to over", 413,
                   BundleLimits(max_unpacked=64 * 1024))
    # a pax header of 200 KiB under a 1-byte file
    padded = [member("x.py", b"x", pax={"comment": "A" * 200 * 1024})]
    assert_refused(tmp_path, write(tmp_path, padded, name="b"), "unpacks to over", 413,
                   BundleLimits(max_unpacked=128 * 1024))


def test_extended_header_bomb_is_refused_before_it_is_read(tmp_path):
    bomb = [member("x.py", b"x", pax={"comment": "A" * (MAX_EXTENDED_HEADER + 1)})]
    assert_refused(tmp_path, write(tmp_path, bomb), "an extended tar header of", 413)
    # GNU long names under the cap are read, and checked against what the filesystem takes
    deep = [member("d/" * 600 + "x.py", b"x")]
    assert inspect_bundle(write(tmp_path, raw=gzip.compress(tar_bytes(deep, fmt=tarfile.GNU_FORMAT)), name="deep"),
                          limits=BundleLimits(max_depth=1000)).names == ("d/" * 600 + "x.py",)
    wide = [member("x" * 300 + ".py", b"x")]
    assert_refused(tmp_path, write(tmp_path, raw=gzip.compress(tar_bytes(wide, fmt=tarfile.GNU_FORMAT)),
                                   name="wide"), "too long for the filesystem")


def test_gzip_bomb_streams_in_bounded_memory(tmp_path):
    data = b"\x00" * (48 * 1024 * 1024)
    path = write(tmp_path, [member("zeros.bin", data), member("ok.py", b"")])
    del data
    assert path.stat().st_size < 1024 * 1024
    tracemalloc.start()
    try:
        info = extract_bundle(path, tmp_path / "code", digest=digest_of(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.unpacked > 48 * 1024 * 1024
    assert (tmp_path / "code" / "zeros.bin").stat().st_size == 48 * 1024 * 1024
    assert peak < 16 * 1024 * 1024, f"extraction held {peak} bytes at once"
    with pytest.raises(BundleError, match="unpacks to over|add up to over") as refused:
        inspect_bundle(path, limits=BundleLimits(max_unpacked=8 * 1024 * 1024))
    assert refused.value.status == 413


def test_limits_from_environment():
    assert BundleLimits.from_env({}) == BundleLimits(10_000, 100 * 1024 * 1024, 500 * 1024 * 1024)
    limits = BundleLimits.from_env({"TRAINYARD_BUNDLE_MAX_FILES": "7", "TRAINYARD_BUNDLE_MAX_BYTES": "1000",
                                    "TRAINYARD_BUNDLE_MAX_UNPACKED_BYTES": "2000"})
    assert limits == BundleLimits(7, 1000, 2000)
    with pytest.raises(ValueError, match="TRAINYARD_BUNDLE_MAX_FILES must be a positive integer"):
        BundleLimits.from_env({"TRAINYARD_BUNDLE_MAX_FILES": "lots"})
    with pytest.raises(ValueError, match="TRAINYARD_BUNDLE_MAX_BYTES"):
        BundleLimits.from_env({"TRAINYARD_BUNDLE_MAX_BYTES": "0"})


def test_bundle_path_layout():
    hexdigest = "ab" + "0" * 62
    assert keys.bundle_path(Path("/a"), "sha256:" + hexdigest) == Path(f"/a/bundles/ab/{hexdigest}.tar.gz")
    assert not is_digest("sha256:" + "A" * 64) and not is_digest("sha256:12") and not is_digest(None)
