"""trainyard.safefs: job-written paths are opened without following anything planted there."""
from __future__ import annotations

import os
import threading

import pytest

from trainyard import safefs


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "root"
    (root / "logs" / "a").mkdir(parents=True)
    (root / "logs" / "a" / "out.log").write_text("hello\n")
    secret = tmp_path / "secret"
    secret.write_text("s3cret")
    return root, secret


def test_reads_a_regular_file_below_the_root(tree):
    root, _ = tree
    assert safefs.read_small(root, "logs/a/out.log", max_bytes=100) == b"hello\n"
    assert safefs.read_beneath(root, "logs/a/out.log", max_bytes=3, offset=1) == b"ell"


def test_a_symlinked_file_is_refused(tree):
    root, secret = tree
    (root / "logs" / "a" / "evil.log").symlink_to(secret)
    with pytest.raises(safefs.UnsafePath):
        safefs.read_small(root, "logs/a/evil.log", max_bytes=100)


def test_a_symlinked_directory_on_the_way_is_refused(tree):
    root, secret = tree
    (root / "logs" / "b").symlink_to(secret.parent)
    with pytest.raises(safefs.UnsafePath):
        safefs.read_small(root, "logs/b/secret", max_bytes=100)


def test_a_fifo_is_refused_without_blocking(tree):
    root, _ = tree
    os.mkfifo(root / "logs" / "a" / "fifo.log")
    done = threading.Event()

    def read():
        with pytest.raises(safefs.UnsafePath):
            safefs.read_small(root, "logs/a/fifo.log", max_bytes=100)
        done.set()

    threading.Thread(target=read, daemon=True).start()
    assert done.wait(5), "opening a FIFO blocked the reader"


def test_dotdot_and_absolute_parts_are_refused(tree):
    root, _ = tree
    for rel in ("../secret", "logs/../../secret", "/etc/passwd", ""):
        with pytest.raises(safefs.UnsafePath):
            safefs.read_small(root, rel, max_bytes=100)


def test_a_file_over_the_limit_is_refused(tree):
    root, _ = tree
    with pytest.raises(safefs.UnsafePath):
        safefs.read_small(root, "logs/a/out.log", max_bytes=3)


def test_writing_creates_parents_and_refuses_a_planted_link(tree):
    root, secret = tree
    fd = safefs.open_beneath(root, "kept/job-1/rank-0.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                             make_dirs=True)
    os.write(fd, b"x")
    os.close(fd)
    assert (root / "kept" / "job-1" / "rank-0.log").read_bytes() == b"x"
    (root / "kept" / "job-1" / "rank-1.log").symlink_to(secret)
    with pytest.raises(safefs.UnsafePath):
        safefs.open_beneath(root, "kept/job-1/rank-1.log", os.O_WRONLY | os.O_APPEND)
    assert secret.read_text() == "s3cret"


def test_list_shows_links_as_links(tree):
    root, secret = tree
    (root / "logs" / "link").symlink_to(secret)
    names = dict(safefs.list_beneath(root, "logs"))
    assert set(names) == {"a", "link"}
    import stat
    assert stat.S_ISLNK(names["link"]) and stat.S_ISDIR(names["a"])
    assert safefs.list_beneath(root, "nowhere") == []
    with pytest.raises(safefs.UnsafePath):
        safefs.list_beneath(root, "logs/link")


def test_is_inside_does_not_resolve():
    assert safefs.is_inside("/a/b/c", "/a/b") and safefs.is_inside("/a/b", "/a/b")
    assert not safefs.is_inside("/a/bc", "/a/b") and not safefs.is_inside("/a/b/../c", "/a/b")
