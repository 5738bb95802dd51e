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


def test_writing_to_a_planted_fifo_is_refused_without_blocking(tree):
    root, _ = tree
    os.mkfifo(root / "logs" / "a" / "rank-0.log")
    done = threading.Event()

    def write():
        with pytest.raises(safefs.UnsafePath):
            safefs.open_beneath(root, "logs/a/rank-0.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        done.set()

    threading.Thread(target=write, daemon=True).start()
    assert done.wait(5), "opening a FIFO for writing blocked the writer"


def test_open_dir_refuses_links_and_makes_missing_directories(tree):
    root, secret = tree
    (root / "logs" / "b").symlink_to(secret.parent)
    with pytest.raises(safefs.UnsafePath):
        safefs.open_dir(root, "logs/b")
    with pytest.raises(safefs.UnsafePath):
        safefs.open_dir(root, "logs/b/deeper", make_dirs=True)
    fd = safefs.open_dir(root, "new/one", make_dirs=True)
    os.close(fd)
    assert (root / "new" / "one").is_dir() and oct((root / "new" / "one").stat().st_mode & 0o777) == "0o700"
    os.close(safefs.open_dir(root))  # "." is the root itself
    with pytest.raises(FileNotFoundError):
        safefs.open_dir(root, "missing")


def test_temporary_files_have_unique_names_and_never_follow_a_planted_one(tree, monkeypatch):
    root, secret = tree
    d = safefs.open_dir(root, "logs/a")
    try:
        fd1, n1 = safefs.create_temp(d, ".x.")
        fd2, n2 = safefs.create_temp(d, ".x.")
        os.close(fd1), os.close(fd2)
        assert n1 != n2 and n1.startswith(".x.") and n1.endswith(".tmp")
        # a name taken (by a planted symlink) is skipped, never opened
        planted = ".x.0000000000000000.tmp"
        (root / "logs" / "a" / planted).symlink_to(secret)
        tokens = iter(["0000000000000000", "1111111111111111"])
        monkeypatch.setattr(safefs.secrets, "token_hex", lambda n: next(tokens))
        fd3, n3 = safefs.create_temp(d, ".x.")
        os.write(fd3, b"mine")
        os.close(fd3)
        assert n3 == ".x.1111111111111111.tmp" and secret.read_text() == "s3cret"
    finally:
        os.close(d)


def test_replace_file_replaces_a_planted_link_not_its_target(tree):
    root, secret = tree
    (root / "logs" / "a" / "side.json").symlink_to(secret)
    d = safefs.open_dir(root, "logs/a")
    try:
        safefs.replace_file(d, "side.json", b"{}")
    finally:
        os.close(d)
    assert secret.read_text() == "s3cret"
    assert not (root / "logs" / "a" / "side.json").is_symlink()
    assert (root / "logs" / "a" / "side.json").read_bytes() == b"{}"
    assert [n for n in os.listdir(root / "logs" / "a") if n.endswith(".tmp")] == []


def test_scan_beneath_gives_lstat_results(tree):
    root, secret = tree
    (root / "logs" / "a" / "link").symlink_to(secret)
    entries = dict(safefs.scan_beneath(root, "logs/a"))
    assert entries["out.log"].st_size == 6
    import stat
    assert stat.S_ISLNK(entries["link"].st_mode)


def test_remove_beneath_removes_a_tree_and_only_unlinks_links(tree):
    root, secret = tree
    outside = secret.parent / "outside"
    outside.mkdir()
    (outside / "keep").write_text("keep")
    (root / "logs" / "a" / "to-outside").symlink_to(outside)
    (root / "logs" / "linked").symlink_to(outside)
    assert safefs.remove_beneath(root, "logs/linked")  # the link goes, not what it points to
    assert (outside / "keep").read_text() == "keep" and not (root / "logs" / "linked").exists()
    with pytest.raises(safefs.UnsafePath):  # a link on the way is not followed
        (root / "logs" / "via").symlink_to(outside)
        safefs.remove_beneath(root, "logs/via/keep")
    assert safefs.remove_beneath(root, "logs/a")
    assert not (root / "logs" / "a").exists() and (outside / "keep").read_text() == "keep"
    assert not safefs.remove_beneath(root, "logs/a") and not safefs.remove_beneath(root, "nowhere/x")
