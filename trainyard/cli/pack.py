"""Pack a code directory into the .tar.gz that POST /api/v1/code/ stores (issue 12, section 1).

What goes in: every regular file and symlink under DIR except .git/ and what .gitignore and
.trainyardignore files exclude. The ignore files use gitignore syntax and semantics (matched
by the pathspec library): each applies to its own directory and below, a deeper file's
patterns override a shallower one's, .trainyardignore's override .gitignore's in the same
directory, and a file inside an excluded directory cannot be re-included (as in git).

Refused with a message naming the file: a file larger than the packed cap (TRAINYARD_BUNDLE_MAX_BYTES,
100 MiB), more than TRAINYARD_BUNDLE_MAX_FILES (10,000) files, more than 500 MiB unpacked, a symlink
pointing outside DIR, a FIFO/socket/device, a file more than TRAINYARD_BUNDLE_MAX_DEPTH (64) path
components deep. The server checks the same limits again.

The archive is reproducible: sorted members, mtime 0, no owner names, modes 0644/0755 and a gzip
header without a timestamp, so the same tree packs to the same sha256 (the server stores it once).
"""
from __future__ import annotations

import gzip
import io
import os
import stat
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from trainyard.bundle import BundleLimits, MiB

from .errors import CliError

IGNORE_FILES = (".gitignore", ".trainyardignore")
ALWAYS_EXCLUDED = {".git"}


def limits_from_env() -> BundleLimits:
    """The server's caps, read from the same variables (trainyard.bundle); the server checks again."""
    try:
        return BundleLimits.from_env()
    except ValueError as exc:
        raise CliError(str(exc)) from None


@dataclass
class Packed:
    data: bytes
    files: list[str] = field(default_factory=list)
    unpacked_bytes: int = 0


def _size(n: int) -> str:
    if n >= MiB:
        return f"{n / MiB:.1f} MiB"
    return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n} bytes"


class IgnoreRules:
    """The .gitignore / .trainyardignore files met so far while walking down from the root."""

    def __init__(self) -> None:
        self._specs: list[tuple[str, object]] = []  # (directory relative to the root, "" for it; spec)

    def load(self, root: Path, rel_dir: str) -> None:
        import pathspec

        lines: list[str] = []
        for name in IGNORE_FILES:
            path = root / rel_dir / name
            if path.is_file():
                lines += path.read_text(errors="replace").splitlines()
        if lines:
            self._specs.append((rel_dir, pathspec.GitIgnoreSpec.from_lines(lines)))

    def ignored(self, rel: str, is_dir: bool) -> bool:
        verdict = False
        for prefix, spec in self._specs:  # shallow first: the deepest matching file decides
            if prefix and not rel.startswith(prefix + "/"):
                continue
            sub = rel[len(prefix) + 1:] if prefix else rel
            result = spec.check_file(sub + "/" if is_dir else sub)
            if result.include is not None:
                verdict = result.include
        return verdict


def collect(root: Path, limits: BundleLimits) -> list[tuple[str, Path]]:
    """(archive name, path) of every member, sorted; CliError for what cannot be bundled."""
    root = root.resolve()
    rules = IgnoreRules()
    members: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root).replace(os.sep, "/")
        rel_dir = "" if rel_dir == "." else rel_dir
        rules.load(root, rel_dir)
        keep = []
        for name in sorted(dirnames):
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if name in ALWAYS_EXCLUDED or rules.ignored(rel, True):
                continue
            if os.path.islink(os.path.join(dirpath, name)):
                filenames.append(name)  # a symlinked directory is bundled as the link, not followed
            else:
                keep.append(name)
        dirnames[:] = keep
        for name in sorted(filenames):
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if not rules.ignored(rel, False):
                members.append((rel, Path(dirpath) / name))
            if len(members) > limits.max_files:
                raise CliError(f"{root} has more than {limits.max_files} files to bundle; "
                               "exclude some with .trainyardignore (or .gitignore)")
    return sorted(members)


def _check_member(root: Path, rel: str, path: Path, limits: BundleLimits) -> os.stat_result:
    if rel.count("/") + 1 > limits.max_depth:
        raise CliError(f"{rel[:80]}...: {rel.count('/') + 1} path components deep, over the bundle limit of "
                       f"{limits.max_depth} (TRAINYARD_BUNDLE_MAX_DEPTH)")
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode):
        target = (path.parent / os.readlink(path)).resolve()
        if target != root and root not in target.parents:
            raise CliError(f"{rel}: a symlink pointing outside {root} ({os.readlink(path)}); "
                           "bundles may only link inside themselves")
    elif not stat.S_ISREG(st.st_mode):
        raise CliError(f"{rel}: not a regular file, directory or symlink; exclude it with .trainyardignore")
    elif st.st_size > limits.max_bytes:
        raise CliError(f"{rel} is {_size(st.st_size)}, over the {_size(limits.max_bytes)} bundle cap; "
                       "add it to .trainyardignore (or .gitignore) and load it from shared storage instead")
    return st


def _tarinfo(tar: tarfile.TarFile, rel: str, path: Path, st: os.stat_result) -> tarfile.TarInfo:
    info = tar.gettarinfo(str(path), arcname=rel)
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = 0
    info.mode = 0o755 if st.st_mode & stat.S_IXUSR else 0o644
    return info


def pack(directory: str | Path, limits: BundleLimits | None = None) -> Packed:
    limits = limits or limits_from_env()
    root = Path(directory)
    if not root.is_dir():
        raise CliError(f"--code {directory}: not a directory")
    root = root.resolve()
    members = collect(root, limits)
    if not members:
        raise CliError(f"--code {directory}: nothing to bundle (empty, or everything is ignored)")
    buf = io.BytesIO()
    packed = Packed(b"")
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel, path in members:
            st = _check_member(root, rel, path, limits)
            info = _tarinfo(tar, rel, path, st)
            if info.isreg():
                packed.unpacked_bytes += info.size
                if packed.unpacked_bytes > limits.max_unpacked:
                    raise CliError(f"{directory} is over the {_size(limits.max_unpacked)} unpacked bundle cap "
                                   f"(reached at {rel}); exclude data and outputs with .trainyardignore")
                with open(path, "rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
            packed.files.append(rel)
            if buf.tell() > limits.max_bytes:
                raise CliError(f"{directory} packs to more than the {_size(limits.max_bytes)} bundle cap "
                               f"(reached at {rel}); exclude data and outputs with .trainyardignore")
    packed.data = buf.getvalue()
    if len(packed.data) > limits.max_bytes:
        raise CliError(f"{directory} packs to {_size(len(packed.data))}, over the {_size(limits.max_bytes)} "
                       "bundle cap; exclude data and outputs with .trainyardignore")
    return packed
