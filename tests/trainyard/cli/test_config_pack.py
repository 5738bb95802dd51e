"""The CLI's login file (0600, XDG, env overrides) and its bundle packing (.gitignore semantics
through pathspec, caps, links, reproducible archives)."""
from __future__ import annotations

import hashlib
import io
import os
import stat
import tarfile

import pytest

from trainyard.cli import config
from trainyard.cli.errors import NOT_LOGGED_IN, CliError
from trainyard.bundle import BundleLimits as Limits
from trainyard.cli.pack import pack


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("TRAINYARD_URL", "TRAINYARD_TOKEN", "TRAINYARD_BUNDLE_MAX_BYTES", "TRAINYARD_BUNDLE_MAX_FILES"):
        monkeypatch.delenv(name, raising=False)


def test_login_file_is_0600_in_a_0700_dir_from_the_start(tmp_path, monkeypatch):
    created = []
    real_open = os.open

    def spy(path, flags, mode=0o777, **kw):
        created.append((str(path), flags, mode))
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(os, "open", spy)
    path = config.save("http://127.0.0.1:8000", 'tok"en\\x')
    assert path == tmp_path / "xdg" / "trainyard" / "config.toml"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    (tmp_name, flags, mode), = created
    assert mode == 0o600 and flags & os.O_EXCL and flags & os.O_CREAT
    assert config.load() == config.Login("http://127.0.0.1:8000", 'tok"en\\x')
    assert not [p for p in path.parent.iterdir() if p.name != "config.toml"]  # no temp file left


def test_home_config_without_xdg_and_env_overrides(tmp_path, monkeypatch):
    monkeypatch.delenv("XDG_CONFIG_HOME")
    assert config.save("https://ty.example/", "abc") == tmp_path / "home" / ".config" / "trainyard" / "config.toml"
    monkeypatch.setenv("TRAINYARD_TOKEN", "from-env")
    assert config.load() == config.Login("https://ty.example", "from-env")
    monkeypatch.setenv("TRAINYARD_URL", "http://other:9/")
    assert config.load() == config.Login("http://other:9", "from-env")


def test_not_logged_in_and_bad_values():
    with pytest.raises(CliError, match="^not logged in: run `trainyard login URL`"):
        config.load()
    assert NOT_LOGGED_IN.endswith("set TRAINYARD_URL and TRAINYARD_TOKEN")
    with pytest.raises(CliError, match="must start with http"):
        config.normalize_url("127.0.0.1:8000")
    config.config_path().parent.mkdir(parents=True)
    config.config_path().write_text("url = [unclosed")
    with pytest.raises(CliError, match="cannot read"):
        config.load()


def _tree(root, files: dict[str, str | bytes]):
    for rel, content in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content if isinstance(content, bytes) else content.encode())
    return root


def _names(packed) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(packed.data), mode="r:gz") as tar:
        return sorted(m.name for m in tar.getmembers())


def test_gitignore_semantics(tmp_path):
    root = _tree(tmp_path / "code", {
        "train.py": "print(1)", "model/net.py": "x = 1", "model/__pycache__/net.cpython-311.pyc": b"\0",
        ".git/HEAD": "ref", ".git/objects/ab": b"\1",
        "data/big.bin": b"\0" * 10, "data/keep.txt": "k",
        "out/run1.log": "l", "notes.log": "n", "important.log": "i",
        "sub/.gitignore": "*.tmp\n!precious.tmp\n", "sub/a.tmp": "a", "sub/precious.tmp": "p", "sub/b.py": "b",
        "other/a.tmp": "kept: the sub/.gitignore does not reach here",
        "vendored/.trainyardignore": "", "secret.env": "S=1", "ckpt/step-1/x": "c",
        ".gitignore": "__pycache__/\n*.log\n!important.log\ndata/*\n!data/keep.txt\nout/\n!out/run1.log\nckpt\n",
        ".trainyardignore": "secret.env\n!notes.log\n",
    })
    names = _names(pack(root))
    assert names == [".gitignore", ".trainyardignore", "data/keep.txt", "important.log", "model/net.py",
                     "notes.log", "other/a.tmp", "sub/.gitignore", "sub/b.py", "sub/precious.tmp",
                     "train.py", "vendored/.trainyardignore"]


def test_reproducible_and_normalised(tmp_path):
    root = _tree(tmp_path / "a", {"train.py": "print(1)", "run.sh": "#!/bin/sh"})
    os.chmod(root / "run.sh", 0o775)
    first = pack(root)
    os.utime(root / "train.py", (1, 1))
    again = pack(root)
    assert hashlib.sha256(first.data).digest() == hashlib.sha256(again.data).digest()
    with tarfile.open(fileobj=io.BytesIO(first.data), mode="r:gz") as tar:
        modes = {m.name: (m.mode, m.uid, m.uname, m.mtime) for m in tar.getmembers()}
    assert modes == {"run.sh": (0o755, 0, "", 0), "train.py": (0o644, 0, "", 0)}
    assert first.unpacked_bytes == len("print(1)") + len("#!/bin/sh") and first.files == ["run.sh", "train.py"]


def test_links_inside_are_kept_outside_refused(tmp_path):
    root = _tree(tmp_path / "code", {"train.py": "x", "lib/util.py": "u"})
    (root / "alias.py").symlink_to("train.py")
    (root / "libdir").symlink_to("lib")
    names = _names(pack(root))
    assert names == ["alias.py", "lib/util.py", "libdir", "train.py"]
    (tmp_path / "secret").write_text("s")
    (root / "leak").symlink_to(tmp_path / "secret")
    with pytest.raises(CliError, match="leak: a symlink pointing outside"):
        pack(root)


def test_caps_name_the_file(tmp_path):
    root = _tree(tmp_path / "code", {"train.py": "x", "weights/model.bin": os.urandom(5000)})
    with pytest.raises(CliError, match=r"^weights/model.bin is 4.9 KiB, over the 3.9 KiB bundle cap; add it "
                                       r"to .trainyardignore"):
        pack(root, Limits(max_bytes=4000))
    (root / ".trainyardignore").write_text("weights/\n")
    assert _names(pack(root, Limits(max_bytes=4000))) == [".trainyardignore", "train.py"]
    with pytest.raises(CliError, match="more than 1 files"):
        pack(root, Limits(max_files=1))
    _tree(root, {"a.txt": "a" * 3000, "b.txt": "b" * 3000})
    with pytest.raises(CliError, match="over the 4.9 KiB unpacked bundle cap"):
        pack(root, Limits(max_unpacked=5000))


def test_fifo_empty_and_missing(tmp_path):
    root = _tree(tmp_path / "code", {"train.py": "x"})
    os.mkfifo(root / "pipe")
    with pytest.raises(CliError, match="^pipe: not a regular file"):
        pack(root)
    (root / ".gitignore").write_text("*\n")
    with pytest.raises(CliError, match="nothing to bundle"):
        pack(root)
    with pytest.raises(CliError, match="not a directory"):
        pack(tmp_path / "nope")


def test_a_tree_deeper_than_the_bundle_limit_is_refused_before_upload(tmp_path):
    deep = tmp_path / "code" / "/".join(["d"] * 64)
    deep.mkdir(parents=True)
    (deep / "x.py").write_text("x = 1\n")  # 65 path components below code/
    with pytest.raises(CliError, match="65 path components deep.*TRAINYARD_BUNDLE_MAX_DEPTH"):
        pack(tmp_path / "code")
    assert pack(tmp_path / "code", Limits(max_depth=65)).files
