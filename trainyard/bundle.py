"""Code bundles: a job's training code as one `.tar.gz`, named by its sha256 (standard library only).

The control plane inspects every upload with `inspect_bundle` before it stores it; a node agent
unpacks one into an attempt's run directory with `extract_bundle`, which re-verifies the hash and
every member while it unpacks. Both share one pass over the archive (`_scan`), so the rules
cannot drift between what was accepted and what is unpacked:

- the file is gzip holding a tar archive; nothing but zero padding follows the archive's end;
- members are regular files, directories, symbolic links and hard links only (no devices, FIFOs,
  sparse or contiguous files); names are relative, without `..`, each at most once, and no
  member lies below a member that is not a directory;
- a symbolic link's target, resolved through the bundle's own links the way the kernel would,
  stays inside the bundle; a hard link names a regular file earlier in the bundle;
- at most `max_files` members, each at most `max_depth` path components deep (a tree thousands of
  directories deep passed inspection but raised RecursionError on the node), `max_bytes` packed and
  `max_unpacked` bytes of decompressed tar stream. The unpacked bytes are counted as they are decompressed (the headers' sizes are only an
  early refusal), the archive is streamed in small reads, and extended headers (pax, GNU long
  names), which `tarfile` reads whole into memory, are capped at `MAX_EXTENDED_HEADER` bytes:
  a gzip or header bomb is refused before it costs memory or disk.

Refusals raise `BundleError(message, status)`: 413 for a size limit, 400 for anything else; so does
any OSError (a full disk, a name too long) or RecursionError met while unpacking, which the node
reports as a user error at once instead of crashing the launch. The bundle file is opened with
O_NOFOLLOW and must be a regular file; `open_stored` opens a stored one below the artifact root
without following any symlink on the way (trainyard.safefs), and both functions take its descriptor.
Extraction unpacks into a temporary sibling of the destination, renames it into place only when
everything passed, and removes it otherwise: a refused bundle leaves nothing behind. The tree is
read-only (files 0444, or 0555 when the member was executable; directories 0555);
`remove_tree` deletes such a tree.
"""
from __future__ import annotations

import gzip
import hashlib
import os
import re
import shutil
import stat
import tarfile
import tempfile
import zlib
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from trainyard import safefs
from trainyard.keys import BUNDLE_PREFIX, bundle_path

MiB = 1024 * 1024
DEFAULT_MAX_FILES = 10_000
DEFAULT_MAX_BYTES = 100 * MiB
DEFAULT_MAX_UNPACKED = 500 * MiB
DEFAULT_MAX_DEPTH = 64
MAX_EXTENDED_HEADER = 1 * MiB
"""The largest pax / GNU long-name header accepted (tarfile holds one whole in memory)."""

MAX_LINK_HOPS = 40
"""Symbolic links followed while resolving one target, as the kernel's ELOOP limit."""

READ_CHUNK = 1 * MiB
GZIP_MAGIC = b"\x1f\x8b"
DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")

ENV_MAX_FILES = "TRAINYARD_BUNDLE_MAX_FILES"
ENV_MAX_BYTES = "TRAINYARD_BUNDLE_MAX_BYTES"
ENV_MAX_UNPACKED = "TRAINYARD_BUNDLE_MAX_UNPACKED_BYTES"
ENV_MAX_DEPTH = "TRAINYARD_BUNDLE_MAX_DEPTH"


class BundleError(Exception):
    """A bundle refused: `message` names the problem, `status` is the HTTP answer (400 or 413)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.message = message
        self.status = status


def _too_big(message: str) -> BundleError:
    return BundleError(message, 413)


@dataclass(frozen=True)
class BundleLimits:
    max_files: int = DEFAULT_MAX_FILES
    max_bytes: int = DEFAULT_MAX_BYTES
    max_unpacked: int = DEFAULT_MAX_UNPACKED
    max_depth: int = DEFAULT_MAX_DEPTH
    """Path components of a member's name at most ("a/b/c.py" is 3)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> BundleLimits:
        """The limits from TRAINYARD_BUNDLE_MAX_FILES, _MAX_BYTES, _MAX_UNPACKED_BYTES and _MAX_DEPTH
        (defaults 10,000 members, 100 MiB packed, 500 MiB unpacked, 64 components deep)."""
        env = os.environ if environ is None else environ

        def read(name: str, default: int) -> int:
            raw = env.get(name, "").strip()
            if not raw:
                return default
            try:
                value = int(raw)
            except ValueError:
                raise ValueError(f"{name} must be a positive integer, not {raw!r}") from None
            if value <= 0:
                raise ValueError(f"{name} must be a positive integer, not {raw!r}")
            return value

        return cls(read(ENV_MAX_FILES, DEFAULT_MAX_FILES), read(ENV_MAX_BYTES, DEFAULT_MAX_BYTES),
                   read(ENV_MAX_UNPACKED, DEFAULT_MAX_UNPACKED), read(ENV_MAX_DEPTH, DEFAULT_MAX_DEPTH))


@dataclass(frozen=True)
class BundleInfo:
    digest: str
    """"sha256:<hex>" of the packed file."""
    bytes: int
    """Packed size (the stored .tar.gz)."""
    files: int
    """Regular files (hard links included)."""
    unpacked: int
    """Bytes of the decompressed tar stream."""
    names: tuple[str, ...]
    """The regular files' normalized paths, sorted (what `entrypoint.script` may name)."""


def is_digest(value: object) -> bool:
    """True for a well-formed bundle id, "sha256:" and 64 lowercase hex digits."""
    return isinstance(value, str) and bool(DIGEST_RE.match(value))


# ---------------------------------------------------------------- readers


class _HashingReader:
    """The packed file: hashes and counts every byte read, refuses past the packed limit."""

    def __init__(self, raw: IO[bytes], limit: int):
        self.raw, self.limit, self.count = raw, limit, 0
        self.sha = hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(READ_CHUNK if size is None or size < 0 else size)
        self.count += len(data)
        if self.count > self.limit:
            raise _too_big(f"the bundle is over {self.limit} bytes packed (TRAINYARD_BUNDLE_MAX_BYTES)")
        self.sha.update(data)
        return data

    def drain(self) -> None:
        while self.read(READ_CHUNK):
            pass


class _CountingReader:
    """The decompressed tar stream: counts real bytes as they come out of zlib, refuses past the
    unpacked limit. Reads are bounded, so a bomb never lands in memory at once."""

    def __init__(self, gz: gzip.GzipFile, limit: int):
        self.gz, self.limit, self.count = gz, limit, 0

    def read(self, size: int = -1) -> bytes:
        size = READ_CHUNK if size is None or size < 0 else min(size, READ_CHUNK)
        try:
            data = self.gz.read(size)
        except (gzip.BadGzipFile, zlib.error, EOFError, OSError) as exc:
            raise BundleError(f"the bundle's gzip data is corrupt or truncated ({exc})") from None
        self.count += len(data)
        if self.count > self.limit:
            raise _too_big(f"the bundle unpacks to over {self.limit} bytes "
                           "(TRAINYARD_BUNDLE_MAX_UNPACKED_BYTES)")
        return data


class _CappedTarInfo(tarfile.TarInfo):
    """Refuses pax and GNU long-name headers over MAX_EXTENDED_HEADER: tarfile reads their whole
    body into memory (`_proc_member` is tarfile's documented hook for subclasses)."""

    def _proc_member(self, tarfile_):
        extended = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE,
                    tarfile.SOLARIS_XHDTYPE)
        if self.type in extended and self.size > MAX_EXTENDED_HEADER:
            raise _too_big(f"an extended tar header of {self.size} bytes (the limit is {MAX_EXTENDED_HEADER})")
        return super()._proc_member(tarfile_)


# ---------------------------------------------------------------- member rules

_FILE_TYPES = (tarfile.REGTYPE, tarfile.AREGTYPE)
_TYPE_NAMES = {tarfile.CHRTYPE: "a character device", tarfile.BLKTYPE: "a block device",
               tarfile.FIFOTYPE: "a FIFO", tarfile.CONTTYPE: "a contiguous file",
               tarfile.GNUTYPE_SPARSE: "a sparse file"}


def _member_path(name: str) -> str:
    """The member's normalized relative path ("" for the archive's root directory)."""
    if name.startswith("/"):
        raise BundleError(f"member {name!r} has an absolute path")
    if "\x00" in name:
        raise BundleError(f"member {name!r} has a NUL byte in its name")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise BundleError(f"member {name!r} has a '..' component")
    if any(len(os.fsencode(p)) > 255 for p in parts) or len(os.fsencode(name)) > 4000:
        raise BundleError(f"member {name[:80]!r}... has a name too long for the filesystem")
    return "/".join(parts)


def _escapes(links: Mapping[str, str], path: str) -> bool:
    """True when symlink `path`, resolved through the bundle's own symlinks like the kernel resolves
    it (a `..` after a link applies to the link's target, not to the name), leaves the bundle, or
    loops."""
    resolved = path.split("/")[:-1]
    pending = deque(links[path].split("/"))
    hops = 0
    while pending:
        part = pending.popleft()
        if part in ("", "."):
            continue
        if part == "..":
            if not resolved:
                return True
            resolved.pop()
            continue
        resolved.append(part)
        target = links.get("/".join(resolved))
        if target is not None:
            hops += 1
            if hops > MAX_LINK_HOPS or target.startswith("/"):
                return True
            resolved.pop()
            pending.extendleft(reversed(target.split("/")))
    return False


class _Table:
    """Every member seen so far, to refuse duplicates, overlaps and links that leave the bundle."""

    def __init__(self, limits: BundleLimits):
        self.limits = limits
        self.members = 0
        self.declared = 0
        self.kinds: dict[str, str] = {}      # path -> "dir" | "file" | "link"
        self.parents: set[str] = set()       # every ancestor directory of a member
        self.links: dict[str, str] = {}      # symlink path -> target
        self.files: list[str] = []

    def add(self, info: tarfile.TarInfo) -> str:
        """Checks one member against the rules and the members before it; its normalized path."""
        self.members += 1
        if self.members > self.limits.max_files:
            raise _too_big(f"the bundle has more than {self.limits.max_files} members (TRAINYARD_BUNDLE_MAX_FILES)")
        path = _member_path(info.name)
        depth = path.count("/") + 1 if path else 0
        if depth > self.limits.max_depth:
            raise BundleError(f"member {info.name[:80]!r}... is {depth} path components deep; the limit is "
                              f"{self.limits.max_depth} (TRAINYARD_BUNDLE_MAX_DEPTH)")
        kind = self._kind(info, path)
        self.declared += max(info.size, 0)
        if self.declared > self.limits.max_unpacked:
            raise _too_big(f"the bundle's files add up to over {self.limits.max_unpacked} bytes "
                           "(TRAINYARD_BUNDLE_MAX_UNPACKED_BYTES)")
        if not path:
            if kind != "dir":
                raise BundleError(f"member {info.name!r} names the bundle's root but is not a directory")
            return path
        self._place(info.name, path, kind)
        if kind == "link" and info.issym():
            self.links[path] = info.linkname
        elif kind == "file":
            self.files.append(path)
        return path

    def _kind(self, info: tarfile.TarInfo, path: str) -> str:
        if info.type in _FILE_TYPES and not info.issparse():
            return "file"
        if info.isdir():
            return "dir"
        if info.issym():
            if info.linkname.startswith("/"):
                raise BundleError(f"symlink {info.name!r} points to an absolute path ({info.linkname!r})")
            if not info.linkname:
                raise BundleError(f"symlink {info.name!r} has an empty target")
            return "link"
        if info.islnk():
            target = _member_path(info.linkname)
            if self.kinds.get(target) != "file":
                raise BundleError(f"hard link {info.name!r} points to {info.linkname!r}, "
                                  "which is not a regular file earlier in the bundle")
            return "file"
        what = _TYPE_NAMES.get(info.type, f"an unsupported member type ({info.type!r})")
        raise BundleError(f"member {info.name!r} is {what}; bundles hold only files, directories and links")

    def _place(self, name: str, path: str, kind: str) -> None:
        previous = self.kinds.get(path)
        if previous is not None and not (previous == "dir" and kind == "dir"):
            raise BundleError(f"member {name!r} appears twice in the bundle")
        if kind != "dir" and path in self.parents:
            raise BundleError(f"member {name!r} is not a directory, but other members lie inside it")
        parts = path.split("/")
        for i in range(1, len(parts)):
            ancestor = "/".join(parts[:i])
            if self.kinds.get(ancestor, "dir") != "dir":
                raise BundleError(f"member {name!r} lies inside {ancestor!r}, which is not a directory")
            self.parents.add(ancestor)
        self.kinds[path] = kind

    def check_links(self) -> None:
        for path, target in self.links.items():
            if _escapes(self.links, path):
                raise BundleError(f"symlink {path!r} points outside the bundle ({target!r})")


# ---------------------------------------------------------------- the one pass

OnMember = Callable[[tarfile.TarFile, tarfile.TarInfo, str], None]


def _open(source: str | os.PathLike[str] | int) -> IO[bytes]:
    """The bundle file from its start: a descriptor is duplicated (the caller keeps its own), a path
    opened with O_NOFOLLOW | O_NONBLOCK (a FIFO cannot stall the reader). Only a regular file is read."""
    if isinstance(source, int):
        fd = os.dup(source)
    else:
        try:
            fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise BundleError(f"the bundle file {source} does not exist") from None
        except OSError as exc:
            raise BundleError(f"the bundle file {source} cannot be opened: a symlink or not a file ({exc})") from None
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        raise BundleError("the bundle is not a regular file (refused, not read)")
    os.set_blocking(fd, True)
    f.seek(0)
    return f


def _scan(source, limits: BundleLimits, on_member: OnMember | None = None) -> tuple[BundleInfo, _Table]:
    """Reads the bundle once: hashes the packed bytes, checks every member (calling `on_member`
    for each, in archive order, to unpack it), then the links and the padding after the end."""
    with _open(source) as raw_file:
        size = os.fstat(raw_file.fileno()).st_size
        if size > limits.max_bytes:
            raise _too_big(f"the bundle is {size} bytes packed; the limit is {limits.max_bytes} "
                           "(TRAINYARD_BUNDLE_MAX_BYTES)")
        if raw_file.read(2) != GZIP_MAGIC:
            raise BundleError("the bundle is not a gzip file (expected a .tar.gz)")
        raw_file.seek(0)
        raw = _HashingReader(raw_file, limits.max_bytes)
        with gzip.GzipFile(fileobj=raw, mode="rb") as gz:
            stream = _CountingReader(gz, limits.max_unpacked)
            table = _Table(limits)
            _walk(stream, table, on_member)
            _check_padding(stream)
        raw.drain()
    table.check_links()
    if not table.files:
        raise BundleError("the bundle holds no files")
    info = BundleInfo(digest=BUNDLE_PREFIX + raw.sha.hexdigest(), bytes=raw.count, files=len(table.files),
                      unpacked=stream.count, names=tuple(sorted(table.files)))
    return info, table


def _walk(stream: _CountingReader, table: _Table, on_member: OnMember | None) -> None:
    try:
        with tarfile.open(fileobj=stream, mode="r|", tarinfo=_CappedTarInfo) as tar:
            for info in tar:
                path = table.add(info)
                if on_member is not None:
                    on_member(tar, info, path)
    except tarfile.TarError as exc:
        raise BundleError(f"the bundle is not a valid tar archive ({exc})") from None
    except UnicodeError as exc:
        raise BundleError(f"the bundle has a member name that is not valid text ({exc})") from None


def _check_padding(stream: _CountingReader) -> None:
    """Reads the decompressed stream to its end (the gzip CRC and length are checked there): only
    zero padding may follow the archive's end, so a corrupt header cannot silently end it early."""
    while True:
        chunk = stream.read(READ_CHUNK)
        if not chunk:
            return
        if chunk.count(0) != len(chunk):
            raise BundleError("the bundle has data after the end of its tar archive (a corrupt header?)")


def inspect_bundle(path: str | os.PathLike[str] | int, *, limits: BundleLimits | None = None) -> BundleInfo:
    """Checks a bundle (a path, or an open descriptor) against every rule without unpacking it;
    raises BundleError on the first."""
    info, _ = _scan(path, limits or BundleLimits())
    return info


def open_stored(root: str | os.PathLike[str], digest: str) -> int:
    """A descriptor of the stored bundle `digest` below the artifact root `root`, no symlink there
    followed: FileNotFoundError when not stored, safefs.UnsafePath when a link or other file is."""
    return safefs.open_beneath(root, bundle_path(Path("."), digest))


# ---------------------------------------------------------------- extraction


class _Unpacker:
    """Writes members under a fresh directory: files with O_EXCL|O_NOFOLLOW as they stream by (in
    bounded chunks), links only after every member passed, modes made read-only last."""

    def __init__(self, root: Path):
        self.root = root
        self.modes: list[tuple[Path, int]] = []
        self.links: list[tarfile.TarInfo] = []

    def __call__(self, tar: tarfile.TarFile, info: tarfile.TarInfo, path: str) -> None:
        if not path:
            return
        target = self.root / path
        if info.isdir():
            target.mkdir(parents=True, exist_ok=True)
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        if info.issym() or info.islnk():
            self.links.append(info)
            return
        source = tar.extractfile(info)
        assert source is not None
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        with source, os.fdopen(os.open(target, flags, 0o600), "wb") as out:
            shutil.copyfileobj(source, out, READ_CHUNK)
        self.modes.append((target, 0o555 if info.mode & 0o111 else 0o444))

    def finish(self) -> None:
        for info in self.links:
            target = self.root / _member_path(info.name)
            if info.issym():
                os.symlink(info.linkname, target)
            else:
                os.link(self.root / _member_path(info.linkname), target, follow_symlinks=False)
        for target, mode in self.modes:
            os.chmod(target, mode)
        for top, _, _ in os.walk(self.root, topdown=False):
            os.chmod(top, 0o555)


def extract_bundle(path: str | os.PathLike[str] | int, dest: str | os.PathLike[str], *, digest: str,
                   limits: BundleLimits | None = None) -> BundleInfo:
    """Unpacks the bundle at `path` (or the open descriptor `path`) into `dest` (which must not exist)
    after checking that its sha256 is `digest` and that every member passes `inspect_bundle`'s rules.
    The tree is read-only. On any refusal (BundleError, also for an OSError or RecursionError met
    while unpacking: a full disk, a name too long) nothing is left at `dest` or beside it."""
    dest = Path(dest)
    if not is_digest(digest):
        raise BundleError(f"{digest!r} is not a bundle id (sha256:<64 hex digits>)")
    if os.path.lexists(dest):
        raise FileExistsError(f"{dest} already exists")
    work = None
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
        unpacker = _Unpacker(work)
        info, _ = _scan(path, limits or BundleLimits(), unpacker)
        if info.digest != digest:
            raise BundleError(f"the bundle's sha256 is {info.digest}, expected {digest} (corrupt or replaced)")
        unpacker.finish()
        os.rename(work, dest)
    except BaseException as exc:
        try:
            if work is not None:
                remove_tree(work)
        except (OSError, RecursionError):
            pass  # a partial tree that cannot be removed is not the error worth reporting
        if isinstance(exc, (OSError, RecursionError)):
            what = "too deep to unpack" if isinstance(exc, RecursionError) else (exc.strerror or str(exc))
            raise BundleError(f"the bundle cannot be unpacked here: {what}") from None
        raise
    return info


def remove_tree(path: str | os.PathLike[str]) -> None:
    """Deletes a directory tree even where it was made read-only (an extracted bundle)."""
    path = Path(path)
    if not os.path.lexists(path):
        return
    if path.is_symlink() or not path.is_dir():
        path.unlink()
        return
    for top, dirs, _ in os.walk(path):
        os.chmod(top, stat.S_IRWXU)
        for name in dirs:
            sub = Path(top) / name
            if not sub.is_symlink():
                os.chmod(sub, stat.S_IRWXU)
    shutil.rmtree(path)
